"""SQLAlchemy tables of vmplane; storage models only (API schemas live in vmplane.api.schemas)."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Table,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship, synonym


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(tzinfo=None)


class Base(DeclarativeBase):
    if TYPE_CHECKING:
        # every model here maps one Table (SQLAlchemy types __table__ as the wider FromClause)
        __table__: ClassVar[Table]


class Zone(Base):
    __tablename__ = "zones"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)


class Cluster(Base):
    __tablename__ = "clusters"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    zone_id: Mapped[int] = mapped_column(ForeignKey("zones.id"), index=True)
    # Guest CPU (issue 33, core/cpumodels.py): the admin's named model (None: the baseline), the baseline of its
    # hosts (recomputed when a host joins or leaves) and, when the hypervisor's baseline was not usable, why not
    cpu_model: Mapped[str | None] = mapped_column(String(64), nullable=True)
    cpu_baseline: Mapped[str | None] = mapped_column(String(64), nullable=True)
    cpu_baseline_why: Mapped[str | None] = mapped_column(Text, nullable=True)
    zone: Mapped[Zone] = relationship(lazy="joined")


class Host(Base):
    __tablename__ = "hosts"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    cluster_id: Mapped[int] = mapped_column(ForeignKey("clusters.id"), index=True)
    driver: Mapped[str] = mapped_column(String(16))  # "sim" or "libvirt"
    uri: Mapped[str | None] = mapped_column(String(1024))
    cores: Mapped[int] = mapped_column(Integer)
    cpu_mhz: Mapped[int] = mapped_column(Integer)
    memory_mib: Mapped[int] = mapped_column(Integer)
    # Its CPU for guests (issue 33): its own model (libvirt's host-model, a sim host's family), the named models
    # it runs (space-separated) and libvirt's host-model CPU XML (a baseline's input); None: never asked
    cpu_model: Mapped[str | None] = mapped_column(String(64), nullable=True)
    cpu_models: Mapped[str | None] = mapped_column(Text, nullable=True)
    cpu_xml: Mapped[str | None] = mapped_column(Text, nullable=True)
    state: Mapped[str] = mapped_column(String(16), default="enabled")
    # Where QEMU on this host listens for incoming migrations (None: derived from the URI).
    migration_address: Mapped[str | None] = mapped_column(String(255), nullable=True)
    # The state a host had when the monitor marked it down (maintenance survives an outage).
    state_before_down: Mapped[str | None] = mapped_column(String(16), nullable=True)
    # High availability: how to power it off (a list of {"agent": local|ipmi|redfish, ...}, tried in order),
    # why it is in its state (fencing: the last fence error), and since when it does not answer.
    fence_agents: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    state_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    down_since: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)
    # Sum of the claims on this host; changed only together with claims, in one transaction.
    used_vcpus: Mapped[int] = mapped_column(Integer, default=0)
    used_memory_mib: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    cluster: Mapped[Cluster] = relationship(lazy="joined")


class Project(Base):
    __tablename__ = "projects"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    quota_vcpus: Mapped[int] = mapped_column(Integer)
    quota_memory_mib: Mapped[int] = mapped_column(Integer)
    quota_vms: Mapped[int] = mapped_column(Integer)
    count_overhead: Mapped[bool] = mapped_column(Boolean, default=False)
    max_concurrent_migrations: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # The ledger: what the project's VMs are charged, kept equal to the recomputed usage.
    used_vcpus: Mapped[int] = mapped_column(Integer, default=0)
    used_memory_mib: Mapped[int] = mapped_column(Integer, default=0)
    used_vms: Mapped[int] = mapped_column(Integer, default=0)
    # Storage: provisioned size of the project's volumes (root disks included), charged while they exist.
    quota_storage_mib: Mapped[int] = mapped_column(Integer, default=1024 * 1024)
    used_storage_mib: Mapped[int] = mapped_column(Integer, default=0)
    quota_backup_mib: Mapped[int] = mapped_column(Integer, default=1024 * 1024)  # what its backups take (issue 32)
    used_backup_mib: Mapped[int] = mapped_column(Integer, default=0)


class Offering(Base):
    __tablename__ = "offerings"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    kind: Mapped[str] = mapped_column(String(32))
    vcpus: Mapped[int | None] = mapped_column(Integer, nullable=True)
    memory_mib: Mapped[int | None] = mapped_column(Integer, nullable=True)
    min_vcpus: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_vcpus: Mapped[int | None] = mapped_column(Integer, nullable=True)
    min_memory_mib: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_memory_mib: Mapped[int | None] = mapped_column(Integer, nullable=True)
    cpu_speed_mhz: Mapped[int] = mapped_column(Integer, default=1000)
    cpu_cap: Mapped[bool] = mapped_column(Boolean, default=False)
    dynamic_scaling: Mapped[bool] = mapped_column(Boolean, default=False)
    retired: Mapped[bool] = mapped_column(Boolean, default=False)  # no new VMs; existing ones keep it
    # Root disk size (None: the template image's size); a custom offering may allow up to max_root_disk_mib.
    root_disk_mib: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_root_disk_mib: Mapped[int | None] = mapped_column(Integer, nullable=True)
    ha_policy: Mapped[str] = mapped_column(String(8), default="off")  # its VMs' default: restart / off
    cpu_model: Mapped[str | None] = mapped_column(String(64), nullable=True)  # None: the cluster's; host-model


class Template(Base):
    __tablename__ = "templates"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    image: Mapped[str] = mapped_column(String(1024))
    dynamically_scalable: Mapped[bool] = mapped_column(Boolean, default=False)
    retired: Mapped[bool] = mapped_column(Boolean, default=False)  # no new VMs; existing ones keep it
    dynamic_scaling = synonym("dynamically_scalable")  # the API's name (as for offerings)
    # The root disk image: None (diskless), a built-in image name (tiny-linux), or an imported file in
    # the image store. Its VMs get a qcow2 overlay on it; `image` "" means they boot from that disk.
    disk_image: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    disk_format: Mapped[str | None] = mapped_column(String(16), nullable=True)
    disk_mib: Mapped[int | None] = mapped_column(Integer, nullable=True)  # its virtual size
    checksum: Mapped[str | None] = mapped_column(String(64), nullable=True)  # sha256 of the imported file


class Image(Base):
    """A disk image uploaded through the API (issue 30), kept once in the image store; a template made
    `from_image` points its disk_image at `file` (so an image is in use while such a template exists)."""

    __tablename__ = "images"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    file: Mapped[str] = mapped_column(String(1024))
    format: Mapped[str] = mapped_column(String(16))
    virtual_mib: Mapped[int] = mapped_column(Integer)
    sha256: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)


class Setting(Base):
    __tablename__ = "settings"
    __table_args__ = (UniqueConstraint("key", "scope", "scope_name"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    key: Mapped[str] = mapped_column(String(128), index=True)
    scope: Mapped[str] = mapped_column(String(16))  # global / zone / cluster
    scope_name: Mapped[str] = mapped_column(String(63), default="")  # "" for global
    value: Mapped[str] = mapped_column(String(256))


class Group(Base):
    """A placement group of one project's VMs: `affinity` (together on one host) or `anti-affinity` (on
    different hosts); `hard` refuses a placement that breaks it, soft only prefers one that keeps it."""

    __tablename__ = "groups"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id"), index=True)
    policy: Mapped[str] = mapped_column(String(16))
    hard: Mapped[bool] = mapped_column(Boolean, default=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    project: Mapped[Project] = relationship(lazy="joined")


class Vm(Base):
    __tablename__ = "vms"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id"), index=True)
    offering_id: Mapped[int] = mapped_column(ForeignKey("offerings.id"))
    template_id: Mapped[int] = mapped_column(ForeignKey("templates.id"))
    # Placement scope: the VM runs in this zone, and in this cluster when one was asked for.
    zone_id: Mapped[int | None] = mapped_column(ForeignKey("zones.id"), nullable=True, index=True)
    cluster_id: Mapped[int | None] = mapped_column(ForeignKey("clusters.id"), nullable=True)
    vcpus: Mapped[int] = mapped_column(Integer)
    memory_mib: Mapped[int] = mapped_column(Integer)
    dynamically_scalable: Mapped[bool] = mapped_column(Boolean, default=True)
    # Ceiling prepared at start (== current size when not prepared for live scaling).
    max_vcpus: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_memory_mib: Mapped[int | None] = mapped_column(Integer, nullable=True)
    cpu_cap_percent: Mapped[float | None] = mapped_column(Float, nullable=True)
    # Memory the guest booted with (set at start): live scaling can never release memory below it.
    boot_memory_mib: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Started with a live-scaling ceiling (all four switches were on then).
    prepared: Mapped[bool] = mapped_column(Boolean, default=False)
    cpu_model: Mapped[str | None] = mapped_column(String(64), nullable=True)  # its domain's, set at each start
    state: Mapped[str] = mapped_column(String(16), default="stopped", index=True)
    host_id: Mapped[int | None] = mapped_column(ForeignKey("hosts.id"), nullable=True, index=True)
    # The host it was last placed on (kept when it stops): where a leftover domain of it can be; a delete asks it.
    last_host_id: Mapped[int | None] = mapped_column(ForeignKey("hosts.id"), nullable=True)
    # High availability: restart it elsewhere when its host fails (restart) or not (off); higher first.
    ha_policy: Mapped[str] = mapped_column(String(8), default="off")
    ha_priority: Mapped[int] = mapped_column(Integer, default=0)
    group_id: Mapped[int | None] = mapped_column(ForeignKey("groups.id"), nullable=True)
    # What this VM has put on its project's ledger (0 while stopped) and its host footprint.
    overhead_mib: Mapped[int] = mapped_column(Integer, default=0)
    charged_vcpus: Mapped[int] = mapped_column(Integer, default=0)
    charged_memory_mib: Mapped[int] = mapped_column(Integer, default=0)
    # cloud-init (issue 30): what its seed says (core/cloudinit.py); None: no seed unless keys are given
    hostname: Mapped[str | None] = mapped_column(String(253), nullable=True)
    ssh_keys: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    user_data: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow, onupdate=utcnow)
    project: Mapped[Project] = relationship(lazy="joined")
    offering: Mapped[Offering] = relationship(lazy="joined")
    template: Mapped[Template] = relationship(lazy="joined")
    host: Mapped[Host | None] = relationship(lazy="joined", foreign_keys=[host_id])
    group: Mapped[Group | None] = relationship(lazy="joined")
    zone: Mapped[Zone | None] = relationship(lazy="joined")
    cluster: Mapped[Cluster | None] = relationship(lazy="joined")


class ProjectKey(Base):
    """An SSH public key of a project, put in the seed of every VM the project creates (unless its create
    says otherwise)."""

    __tablename__ = "project_keys"
    __table_args__ = (UniqueConstraint("project_id", "name"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id"), index=True)
    name: Mapped[str] = mapped_column(String(63))
    key: Mapped[str] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)


class Pool(Base):
    """A storage pool: a host's own (`local`, host_id set) or one every host of a cluster sees (`shared`).
    capacity/allocation/available are read back from a host; used_mib is what vmplane's volumes (and
    copies in flight into it) take, by provisioned size: changed with the volumes, in one transaction."""

    __tablename__ = "pools"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    kind: Mapped[str] = mapped_column(String(16))  # local / shared
    cluster_id: Mapped[int] = mapped_column(ForeignKey("clusters.id"), index=True)
    host_id: Mapped[int | None] = mapped_column(ForeignKey("hosts.id"), nullable=True, index=True)
    path: Mapped[str] = mapped_column(String(1024))
    state: Mapped[str] = mapped_column(String(16), default="unknown")
    capacity_mib: Mapped[int] = mapped_column(Integer, default=0)
    allocation_mib: Mapped[int] = mapped_column(Integer, default=0)
    available_mib: Mapped[int] = mapped_column(Integer, default=0)
    used_mib: Mapped[int] = mapped_column(Integer, default=0)
    shared_checked: Mapped[bool] = mapped_column(Boolean, default=False)  # a probe volume seen by every host
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    cluster: Mapped[Cluster] = relationship(lazy="joined")
    host: Mapped[Host | None] = relationship(lazy="joined")


class Volume(Base):
    """A disk: a VM's root disk (role root) or a volume (role data). Charged to its project while the row
    exists; `state` is the step it is in (creating, available, attached, attaching, detaching, deleting),
    so a crash between asking a host and recording its answer is resolved by asking again."""

    __tablename__ = "volumes"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id"), index=True)
    pool_id: Mapped[int] = mapped_column(ForeignKey("pools.id"), index=True)
    copy_pool_id: Mapped[int | None] = mapped_column(ForeignKey("pools.id"), nullable=True)  # a migration's copy
    # a `volume move` (or a cold migration's disk) in flight (state moving): the pool and file it is copied to,
    # claimed there at admission; `move_kind` live (block copy), cold (one host sees both pools), across (hosts)
    move_pool_id: Mapped[int | None] = mapped_column(ForeignKey("pools.id"), nullable=True)
    move_file: Mapped[str | None] = mapped_column(String(128), nullable=True)
    move_kind: Mapped[str | None] = mapped_column(String(8), nullable=True)
    # its file in the pool (and in a copy's pool): unique per volume, so a new volume never meets a file
    # an older one of the same name left behind (review N2); None: the name's file (rows made before 0010)
    file_name: Mapped[str | None] = mapped_column(String(128), nullable=True)
    # a linked clone's (issue 32): the file of another volume of the same pool its first file is an overlay on (a
    # snapshot's base: read-only; that volume keeps it, unmerged, while a clone reads it)
    base_file: Mapped[str | None] = mapped_column(String(128), nullable=True)
    size_mib: Mapped[int] = mapped_column(Integer)
    format: Mapped[str] = mapped_column(String(16), default="qcow2")
    role: Mapped[str] = mapped_column(String(8), default="data")  # root / data
    template_id: Mapped[int | None] = mapped_column(ForeignKey("templates.id"), nullable=True)  # its backing
    vm_id: Mapped[int | None] = mapped_column(ForeignKey("vms.id"), nullable=True, index=True)
    device: Mapped[str | None] = mapped_column(String(8), nullable=True)  # vda, vdb, ...
    state: Mapped[str] = mapped_column(String(16), default="creating", index=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow, onupdate=utcnow)
    project: Mapped[Project] = relationship(lazy="joined")
    pool: Mapped[Pool] = relationship(lazy="joined", foreign_keys=[pool_id])
    vm: Mapped[Vm | None] = relationship(lazy="joined")


class Snapshot(Base):
    """A disk snapshot of a VM (issue 32): an external one, its metadata here and not in libvirt (a VM with
    snapshots still live-migrates). `state`: taking (asked, not yet read back), ready, reverting, deleting:
    a crash between asking a host and recording its answer is settled by reading the disks back."""

    __tablename__ = "snapshots"
    __table_args__ = (UniqueConstraint("vm_id", "name"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    vm_id: Mapped[int] = mapped_column(ForeignKey("vms.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(63))
    state: Mapped[str] = mapped_column(String(16), default="taking")
    quiesced: Mapped[bool] = mapped_column(Boolean, default=False)
    live: Mapped[bool] = mapped_column(Boolean, default=False)  # taken while the VM ran
    pause_ms: Mapped[int | None] = mapped_column(Integer, nullable=True)  # the guest's pause (freeze to thaw)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    step_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)  # when its state last changed


class SnapshotFile(Base):
    """One disk of a snapshot: the file that was its volume's active file when the snapshot was taken (its
    base, read-only since), and the overlay the snapshot put on top of it."""

    __tablename__ = "snapshot_files"
    snapshot_id: Mapped[int] = mapped_column(ForeignKey("snapshots.id", ondelete="CASCADE"), primary_key=True)
    volume_id: Mapped[int] = mapped_column(ForeignKey("volumes.id", ondelete="CASCADE"), primary_key=True)
    base: Mapped[str] = mapped_column(String(128))
    overlay: Mapped[str] = mapped_column(String(128))


class VolumeFile(Base):
    """A file of a volume's qcow2 chain beyond a volume that never had a snapshot (which has its one file,
    `volumes.file_name`): every file of the chain with its parent (None: the volume's first file, on the
    template's image or on nothing). `volumes.file_name` stays the active file, the one the domain opens."""

    __tablename__ = "volume_files"
    __table_args__ = (UniqueConstraint("volume_id", "file"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    volume_id: Mapped[int] = mapped_column(ForeignKey("volumes.id", ondelete="CASCADE"), index=True)
    file: Mapped[str] = mapped_column(String(128))
    parent: Mapped[str | None] = mapped_column(String(128), nullable=True)
    # pending: asked of the host, not confirmed; live; deleting: no chain needs it, its deletion not confirmed.
    # Each file is charged at its volume's size (an overlay may grow to it) until its row goes.
    state: Mapped[str] = mapped_column(String(16), default="pending")


class LeftoverFile(Base):
    """A file no volume owns any more that its pool has not confirmed deleted yet (the old file of a moved
    volume, a move's partial copy): its space stays taken on the pool until the storage settle deletes it."""

    __tablename__ = "leftover_files"
    __table_args__ = (UniqueConstraint("pool_id", "file"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    pool_id: Mapped[int] = mapped_column(ForeignKey("pools.id"))
    file: Mapped[str] = mapped_column(String(128))
    size_mib: Mapped[int] = mapped_column(Integer)
    volume: Mapped[str] = mapped_column(String(63))  # whose file it was (for the event log)
    why: Mapped[str] = mapped_column(String(255))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)


class BackupStore(Base):
    """A directory every host of a cluster sees (as a shared pool is), where backups are written: a libvirt
    directory pool of the same name on each host, checked by a probe file written through one host and read
    through the others."""

    __tablename__ = "backup_stores"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    path: Mapped[str] = mapped_column(String(1024))
    cluster_id: Mapped[int] = mapped_column(ForeignKey("clusters.id"), index=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)


class Backup(Base):
    """A backup of a VM's disks (issue 32: its root disk and data volumes, one file each: `BackupDisk`) through
    libvirt's backup API: `full`, or `incremental` on its `parent` (a disk's file has the parent's file of the
    same volume as its backing file: the chain restores whole). `checkpoint`: the libvirt checkpoint taken with
    it (the next incremental's start). What the VM was is kept (offering, template, vCPUs, memory): a restore
    makes a new VM of it, even once the VM is gone. `state`: running (asked, not confirmed), ready, deleting;
    `bytes` (its files' sizes, read back) and `written` (what the job transferred) once written."""

    __tablename__ = "backups"
    id: Mapped[int] = mapped_column(primary_key=True)
    store_id: Mapped[int] = mapped_column(ForeignKey("backup_stores.id"), index=True)
    vm_id: Mapped[int | None] = mapped_column(ForeignKey("vms.id", ondelete="SET NULL"), nullable=True, index=True)
    vm_name: Mapped[str] = mapped_column(String(63))
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id"), index=True)
    offering: Mapped[str] = mapped_column(String(63))
    template: Mapped[str] = mapped_column(String(63))
    vcpus: Mapped[int] = mapped_column(Integer)
    memory_mib: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))  # full | incremental
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("backups.id"), nullable=True)
    checkpoint: Mapped[str] = mapped_column(String(63))
    state: Mapped[str] = mapped_column(String(16), default="running")
    progress: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # % of the job, while running
    size_mib: Mapped[int] = mapped_column(Integer)  # its disks' sizes
    charged_mib: Mapped[int] = mapped_column(Integer)  # on the project's backup quota
    bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # its files' sizes, read back
    written: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # what the backup job transferred
    checkpoint_xml: Mapped[str | None] = mapped_column(Text, nullable=True)  # defined again where the VM runs
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)


class BackupDisk(Base):
    """One disk of a backup: the volume it was (`volume`, its `device`, `role` and `pool` then), the disk's active
    file when it was taken (`disk_file`: an incremental builds on it only while it still is), its file in the
    store (`mode` full, or incremental: backed by the parent backup's file of the same volume; a later backup's
    file may be backed by it: its name never changes), read back."""

    __tablename__ = "backup_disks"
    id: Mapped[int] = mapped_column(primary_key=True)
    backup_id: Mapped[int] = mapped_column(ForeignKey("backups.id", ondelete="CASCADE"), index=True)
    device: Mapped[str] = mapped_column(String(16))
    volume: Mapped[str] = mapped_column(String(63))
    role: Mapped[str] = mapped_column(String(16))  # root | data
    pool: Mapped[str] = mapped_column(String(63))
    mode: Mapped[str] = mapped_column(String(16))  # full | incremental
    size_mib: Mapped[int] = mapped_column(Integer)
    disk_file: Mapped[str] = mapped_column(String(128))
    file: Mapped[str] = mapped_column(String(128))
    bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # a whole copy of the disk's chain, made to rewrite `file` in place (a prune deletes its base: later backups'
    # files keep `file` as their backing file, so it must stay at that name); while set, the settle finishes it
    whole_file: Mapped[str | None] = mapped_column(String(128), nullable=True)
    whole_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)  # when it was named


class BackupSchedule(Base):
    """When a VM's (or every running VM of a project's) backups are taken: a cron expression, run by the process
    that wins the compare-and-set of `next_run_at` (exactly once across processes), then the retention."""

    __tablename__ = "backup_schedules"
    id: Mapped[int] = mapped_column(primary_key=True)
    vm_id: Mapped[int | None] = mapped_column(ForeignKey("vms.id", ondelete="CASCADE"), nullable=True, unique=True)
    project_id: Mapped[int | None] = mapped_column(ForeignKey("projects.id"), nullable=True, unique=True)
    cron: Mapped[str] = mapped_column(String(100))
    store_id: Mapped[int] = mapped_column(ForeignKey("backup_stores.id"))
    keep_last: Mapped[int | None] = mapped_column(Integer, nullable=True)
    keep_daily: Mapped[int | None] = mapped_column(Integer, nullable=True)
    next_run_at: Mapped[dt.datetime] = mapped_column(DateTime, index=True)
    last_run_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)
    last_result: Mapped[str | None] = mapped_column(Text, nullable=True)


class Network(Base):
    """A guest network: a project's isolated network (`isolated`, project_id set) or an admin's network bridged
    to the hosts' uplink (`provider`, project_id None; `shared`: every project's VMs may use it). Its zone's
    hosts carry it as one Linux bridge each, joined by a VXLAN device (core/networks.py names them)."""

    __tablename__ = "networks"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    kind: Mapped[str] = mapped_column(String(16))  # isolated / provider
    project_id: Mapped[int | None] = mapped_column(ForeignKey("projects.id"), nullable=True, index=True)
    zone_id: Mapped[int] = mapped_column(ForeignKey("zones.id"), index=True)
    cidr: Mapped[str] = mapped_column(String(43))
    gateway: Mapped[str] = mapped_column(String(39))
    shared: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    project: Mapped[Project | None] = relationship(lazy="joined")
    zone: Mapped[Zone] = relationship(lazy="joined")


class Nic(Base):
    """A VM's network card: its MAC (derived from its id, core/networks.mac_of) and address, allocated in its
    own transaction and never changed while it exists; `state` the step it is in (attached, attaching,
    detaching), as a volume's."""

    __tablename__ = "nics"
    __table_args__ = (UniqueConstraint("network_id", "ip"), UniqueConstraint("vm_id", "slot"))
    id: Mapped[int] = mapped_column(primary_key=True)
    vm_id: Mapped[int] = mapped_column(ForeignKey("vms.id"), index=True)
    network_id: Mapped[int] = mapped_column(ForeignKey("networks.id"), index=True)
    slot: Mapped[int] = mapped_column(Integer)  # its order on the VM: the first NIC is slot 0
    mac: Mapped[str | None] = mapped_column(String(17), unique=True, nullable=True)  # set in the insert's transaction
    ip: Mapped[str] = mapped_column(String(39))
    state: Mapped[str] = mapped_column(String(16), default="attached")
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)


class GuestAgent(Base):
    """What a running VM's guest agent last said (issue 30): whether it answers (`connected`, or `none`: no
    agent, a hung one, a guest still booting) and the guest's interfaces with their addresses (JSON: a list
    of {name, mac, addresses}), as the agent controller read them. Written only when one of them changed."""

    __tablename__ = "guest_agents"
    vm_id: Mapped[int] = mapped_column(ForeignKey("vms.id"), primary_key=True)
    state: Mapped[str] = mapped_column(String(16))
    interfaces: Mapped[str] = mapped_column(Text, default="[]")
    host: Mapped[str] = mapped_column(String(255))  # the host it was read on (a moved VM is read again)
    changed_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)


class ConsoleTicket(Base):
    """A serial console ticket (issue 31): only its hash is kept; single-use (`used_at` set in the transaction
    that redeems it), redeemable until `expires_at`, bound to the VM, the caller's token and, from a browser,
    its console session (core/consoles.py)."""

    __tablename__ = "console_tickets"
    id: Mapped[int] = mapped_column(primary_key=True)
    digest: Mapped[str] = mapped_column(String(64), unique=True)
    vm_id: Mapped[int] = mapped_column(ForeignKey("vms.id", ondelete="CASCADE"), index=True)
    token_hash: Mapped[str] = mapped_column(String(64))
    session_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    expires_at: Mapped[dt.datetime] = mapped_column(DateTime, index=True)
    used_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)


class SecGroup(Base):
    """A project's security group; its NICs' traffic is what its rules allow (`default`: inbound from its own
    members, all outbound)."""

    __tablename__ = "secgroups"
    __table_args__ = (UniqueConstraint("project_id", "name"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(63))
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id"), index=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)


class SecGroupRule(Base):
    __tablename__ = "secgroup_rules"
    id: Mapped[int] = mapped_column(primary_key=True)
    secgroup_id: Mapped[int] = mapped_column(ForeignKey("secgroups.id", ondelete="CASCADE"), index=True)
    direction: Mapped[str] = mapped_column(String(3))  # in / out
    proto: Mapped[str] = mapped_column(String(8))  # tcp / udp / icmp / any
    port_min: Mapped[int | None] = mapped_column(Integer, nullable=True)
    port_max: Mapped[int | None] = mapped_column(Integer, nullable=True)
    cidr: Mapped[str | None] = mapped_column(String(43), nullable=True)
    remote_group_id: Mapped[int | None] = mapped_column(ForeignKey("secgroups.id"), nullable=True)


class NicSecGroup(Base):
    __tablename__ = "nic_secgroups"
    nic_id: Mapped[int] = mapped_column(ForeignKey("nics.id", ondelete="CASCADE"), primary_key=True)
    secgroup_id: Mapped[int] = mapped_column(ForeignKey("secgroups.id"), primary_key=True, index=True)


class Claim(Base):
    __tablename__ = "claims"
    id: Mapped[int] = mapped_column(primary_key=True)
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id"), index=True)
    vm_id: Mapped[int] = mapped_column(ForeignKey("vms.id"), index=True)
    operation_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    kind: Mapped[str] = mapped_column(String(24))
    vcpus: Mapped[int] = mapped_column(Integer)
    memory_mib: Mapped[int] = mapped_column(Integer)


class Operation(Base):
    __tablename__ = "operations"
    __table_args__ = (Index("ix_operations_created_at", "created_at"),)  # history pruning, newest-first lists
    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    kind: Mapped[str] = mapped_column(String(24))
    target: Mapped[str] = mapped_column(String(63))
    vm_id: Mapped[int | None] = mapped_column(Integer, nullable=True, index=True)
    project_id: Mapped[int | None] = mapped_column(Integer, nullable=True, index=True)
    state: Mapped[str] = mapped_column(String(16), default="pending", index=True)
    step: Mapped[str] = mapped_column(String(32), default="admitted")
    progress: Mapped[int] = mapped_column(Integer, default=0)
    message: Mapped[str] = mapped_column(Text, default="")
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow, onupdate=utcnow)
    owner: Mapped[int | None] = mapped_column(Integer, nullable=True, index=True)  # the controller running it


class Migration(Base):
    __tablename__ = "migrations"
    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    vm_id: Mapped[int] = mapped_column(ForeignKey("vms.id", ondelete="CASCADE"), index=True)
    vm_name: Mapped[str] = mapped_column(String(63))
    project_id: Mapped[int] = mapped_column(Integer, index=True)
    source_host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id"))
    target_host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id"))
    source: Mapped[str] = mapped_column(String(63))
    target: Mapped[str] = mapped_column(String(63))
    cluster: Mapped[str] = mapped_column(String(63))
    state: Mapped[str] = mapped_column(String(16), index=True)
    reason: Mapped[str] = mapped_column(Text, default="")  # why it failed / waits / what drains it
    waiting_for: Mapped[str] = mapped_column(Text, default="")
    progress: Mapped[int] = mapped_column(Integer, default=0)
    params: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    stats: Mapped[dict[str, Any] | None] = mapped_column(
        JSON, nullable=True
    )  # total_ms, downtime_ms, bytes, guest check
    operation_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    started_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)
    owner: Mapped[int | None] = mapped_column(Integer, nullable=True, index=True)  # the controller copying it
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)
    # a cancel taken by any process: the one copying sees it (its progress loop) and aborts (review N6)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)


class Token(Base):
    __tablename__ = "tokens"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    role: Mapped[str] = mapped_column(String(16))  # admin / member
    project_id: Mapped[int | None] = mapped_column(ForeignKey("projects.id"), nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)


class ConsoleSession(Base):
    """A web console login (review N10): the browser's cookie holds a random session id, the store only its
    hash. It acts as the token it was opened with, and ends at logout, at `expires_at`, or with the token
    (revoked: the rows go with it, ON DELETE CASCADE)."""

    __tablename__ = "console_sessions"
    id: Mapped[int] = mapped_column(primary_key=True)
    id_hash: Mapped[str] = mapped_column(String(64), unique=True)
    token_id: Mapped[int] = mapped_column(ForeignKey("tokens.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    expires_at: Mapped[dt.datetime] = mapped_column(DateTime, index=True)


class Event(Base):
    """One state change of a VM, host, migration or operation, with its cause (the event log)."""

    __tablename__ = "events"
    __table_args__ = (Index("ix_events_kind_subject", "kind", "subject"),)  # an operation's or migration's cause
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow, index=True)
    kind: Mapped[str] = mapped_column(String(16))
    subject: Mapped[str] = mapped_column(String(63))
    project_id: Mapped[int | None] = mapped_column(Integer, nullable=True, index=True)
    vm: Mapped[str | None] = mapped_column(String(63), nullable=True, index=True)
    host: Mapped[str | None] = mapped_column(String(63), nullable=True, index=True)
    old_state: Mapped[str | None] = mapped_column(String(24), nullable=True)
    new_state: Mapped[str | None] = mapped_column(String(24), nullable=True)
    cause: Mapped[str] = mapped_column(String(128))
    message: Mapped[str] = mapped_column(Text, default="")


class Controller(Base):
    """One control-plane process, from its start to its end or its lease's lapse. `epoch` (monotonic) is its
    fencing token: its background writes check in the same transaction that it is still `live` and
    unexpired (ownership.py). Times are the database's clock, in seconds since 1970."""

    __tablename__ = "controllers"
    epoch: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128))
    hostname: Mapped[str] = mapped_column(String(128))
    pid: Mapped[int] = mapped_column(Integer)
    api_url: Mapped[str | None] = mapped_column(String(255), nullable=True)
    state: Mapped[str] = mapped_column(String(16), index=True)  # live, lapsed, stopped
    lease_s: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float] = mapped_column(Float)
    renewed_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float] = mapped_column(Float)


class Lease(Base):
    """Work only one process may do: `coordinator` (recovery, settling, HA, the queue) and `host:NAME` (that
    host's monitor, sync and events). Held while its holder controller is live; `epoch` counts its hand-overs."""

    __tablename__ = "leases"
    name: Mapped[str] = mapped_column(String(80), primary_key=True)
    holder: Mapped[int | None] = mapped_column(Integer, nullable=True)
    epoch: Mapped[int] = mapped_column(Integer, default=0)
    acquired_at: Mapped[float] = mapped_column(Float)


class StatSample(Base):
    """One object's usage in one bucket of a tier (issue 33's graphs: core/stats.py's rules, store/stats.py).
    `kind` vm, host or project; `obj_id` its id; `bucket` the bucket's start in seconds since 1970. Written by
    upsert on the whole key: a round written twice (two processes, a retry) leaves one point."""

    __tablename__ = "stat_samples"
    __table_args__ = (Index("ix_stat_samples_tier_bucket", "tier", "bucket"),)  # pruning, the latest round
    kind: Mapped[str] = mapped_column(String(8), primary_key=True)
    obj_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tier: Mapped[str] = mapped_column(String(4), primary_key=True)
    bucket: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    cpu_pct: Mapped[float | None] = mapped_column(Float, nullable=True)
    cpu_cores: Mapped[float | None] = mapped_column(Float, nullable=True)
    mem_used_mib: Mapped[float | None] = mapped_column(Float, nullable=True)
    mem_total_mib: Mapped[float | None] = mapped_column(Float, nullable=True)
    disk_rd_bps: Mapped[float | None] = mapped_column(Float, nullable=True)
    disk_wr_bps: Mapped[float | None] = mapped_column(Float, nullable=True)
    net_rx_bps: Mapped[float | None] = mapped_column(Float, nullable=True)
    net_tx_bps: Mapped[float | None] = mapped_column(Float, nullable=True)
