"""A VM's cloud-init seed on its host (issue 30): the NoCloud image its record says (store/seeds.seed_of,
core/cloudinit.files, hosts/seediso.build_iso), put in the host's image pool under a name that follows its
content (`vmp-seed-<vm>-<seed id>.iso`, the same path on every host) and attached as a read-only CD-ROM.

The seed is never copied between hosts: it is made again from the record wherever the VM goes, before its
start, its HA restart and its migration's copy (the same record gives the same bytes, so a migrated domain
finds its CD-ROM at the same path with the same content). A changed record (a NIC added) gives a new name at
the next start.
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING

from vmplane.core import cloudinit as CI
from vmplane.core import storagerules as R
from vmplane.core.driver import DiskSpec, PoolSpec
from vmplane.hosts import seediso
from vmplane.store import seeds as SS

if TYPE_CHECKING:
    from vmplane.plane.context import Plane

TARGET = "sda"  # the seed's CD-ROM (the volumes are virtio: vdX)


class Seeds:
    def __init__(self, plane: Plane):
        self.plane = plane

    def disk_for(self, vm_id: int, host: str) -> DiskSpec | None:
        """The VM's seed as a CD-ROM on `host`, made there first; None when the VM asks for no seed."""
        with self.plane.db.read() as s:
            seed = SS.seed_of(s.connection(), vm_id)
        if seed is None:
            return None
        name = f"vmp-seed-{seed.instance_id}-{CI.seed_id(seed)}.iso"
        driver = self.plane.drivers[host]
        driver.define_pool(PoolSpec(R.IMAGE_POOL, R.IMAGES_PATH))
        found = driver.volume(R.IMAGE_POOL, name)
        if found is None:
            fd, path = tempfile.mkstemp(suffix=".iso", prefix="vmplane-seed-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(seediso.build_iso(CI.files(seed)))
                found = driver.upload_volume(R.IMAGE_POOL, name, path, "raw")
            finally:
                os.unlink(path)
        return DiskSpec(R.IMAGE_POOL, name, found.path, TARGET, "raw", readonly=True, device="cdrom")
