"""An uploaded image's file (issue 30): written chunk by chunk to a temporary file in the control plane's
image store while its sha256 is computed, then checked (the client's sha256, then `qemu-img info`) and moved
to its name there, or deleted. Nothing of a refused upload stays in the store."""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from vmplane.core.errors import Invalid
from vmplane.hosts.images import ImageFacts, inspect, store_dir

PART_PREFIX = ".upload-"
STALE_S = 24 * 3600  # a temporary file this old was left by a server that died mid-upload


@dataclass(frozen=True)
class Stored:
    facts: ImageFacts
    size: int  # bytes
    made: bool  # False: the store held this very file already (same name and checksum)


def _drop_stale(store: Path) -> None:
    for part in store.glob(f"{PART_PREFIX}*.part"):
        try:
            if time.time() - part.stat().st_mtime > STALE_S:
                part.unlink()
        except FileNotFoundError:
            pass


def _is_plain_iso(path: Path) -> bool:
    """An ISO 9660 volume (a CD-ROM image) without a boot sector: qemu-img calls it raw, but it is no disk.
    (A hybrid ISO, with a master boot record, boots as a disk and is taken.)"""
    with open(path, "rb") as f:
        head = f.read(32774)
    return head[32769:32774] == b"CD001" and head[510:512] != b"\x55\xaa"


class Upload:
    """One upload under way: write() its chunks, then finish() with the client's sha256, or discard()."""

    def __init__(self, name: str):
        self.name = name
        self.store = store_dir()
        self.store.mkdir(parents=True, exist_ok=True)
        _drop_stale(self.store)
        fd, tmp = tempfile.mkstemp(prefix=f"{PART_PREFIX}{name}-", suffix=".part", dir=self.store)
        self.path = Path(tmp)
        self._file = os.fdopen(fd, "wb")
        self._digest = hashlib.sha256()
        self.size = 0

    def write(self, chunk: bytes) -> None:
        self._file.write(chunk)
        self._digest.update(chunk)
        self.size += len(chunk)

    def discard(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)

    def finish(self, sha256: str) -> Stored:
        """Check the file and keep it as `<name>-<sha256[:12]>.<format>` (the name hosts' image pools get);
        Invalid naming `sha256` or `image` (the temporary file deleted) when it is not what was sent or not
        a disk image."""
        self._file.flush()
        os.fsync(self._file.fileno())  # registered only once it is on disk
        self._file.close()
        actual = self._digest.hexdigest()
        try:
            if actual != sha256:
                raise Invalid(
                    f"the upload does not match its sha256: {self.size} bytes came, whose sha256 is {actual}, not "
                    f"{sha256} (cut short or corrupted on the way); nothing was registered, upload it again",
                    field="sha256",
                )
            fmt, virtual_mib = self._inspect()
        except Invalid:
            self.path.unlink(missing_ok=True)
            raise
        target = self.store / f"{self.name}-{actual[:12]}.{fmt}"
        made = not target.exists()
        if made:
            os.chmod(self.path, 0o644)  # as an imported image's copy (mkstemp made it 0600)
            os.replace(self.path, target)
        else:
            self.path.unlink()
        return Stored(ImageFacts(str(target), fmt, virtual_mib, actual), self.size, made)

    def _inspect(self) -> tuple[str, int]:
        try:
            fmt, virtual_mib = inspect(str(self.path))
        except Invalid as exc:
            raise Invalid(f"the uploaded file is not a disk image: {exc.message}", field="image") from None
        if fmt == "raw" and _is_plain_iso(self.path):
            raise Invalid(
                "the uploaded file is an ISO 9660 volume (a CD-ROM image), not a disk image; vmplane takes "
                "qcow2 or raw disk images",
                field="image",
            )
        return fmt, virtual_mib
