"""Admin objects in the store: zones, clusters, projects, offerings, templates, settings, tokens.

Thin: validation rules are in names/offerings/settings/quota; this module reads and writes rows.
VM lifecycle and hosts (which need drivers) are the controllers' (controllers/vms.py, controllers/hostadmin.py).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import threading
from collections.abc import Callable
from operator import attrgetter
from typing import Any, TypeVar, cast

from sqlalchemy import bindparam, delete, func, select
from sqlalchemy.engine import Connection, CursorResult
from sqlalchemy.orm import Session

from vmplane.core import cpumodels
from vmplane.core import settings as settings_rules
from vmplane.core.errors import AlreadyExists, Conflict, Invalid, NotFound, Unauthorized
from vmplane.core.model import (
    CHARGED_STATES,
    DEFAULT_STORAGE_QUOTA_MIB,
    IN_FLIGHT_OPERATION_STATES,
    OfferingKind,
    Quota,
    Size,
    Usage,
    VmState,
)
from vmplane.core.model import Offering as OfferingData
from vmplane.core.names import NAME_RE, check_name
from vmplane.core.offerings import validate_offering
from vmplane.core.quota import check_quota_change, recompute_usage, running_charge, storage_usage
from vmplane.store import Database
from vmplane.store import images as image_rows
from vmplane.store.prepared import once_per_transaction, prepared
from vmplane.store.schema import (
    Base,
    Cluster,
    Host,
    Offering,
    Operation,
    Project,
    Setting,
    Template,
    Token,
    Vm,
    Volume,
    VolumeFile,
    Zone,
)

# the models looked up by their unique name
_Named = TypeVar("_Named", bound=Zone | Cluster | Host | Project | Offering | Template | Vm | Token)
# the models a VM is made from, read once and cached, retired rather than changed
_Immutable = TypeVar("_Immutable", Offering, Template)
# every setting as the store has it: key -> (scope, scope name or None) -> value's text
_Settings = dict[str, dict[tuple[str, str | None], str]]


def get_by_name(
    s: Session, model: type[_Named], name: str, field: str | None = None, for_update: bool = False
) -> _Named:
    stmt = select(model).where(model.name == name)
    if for_update:
        stmt = stmt.with_for_update(of=model)  # (PostgreSQL: not the outer-joined eager loads)
    row = s.execute(stmt).unique().scalar_one_or_none()
    if row is None:
        noun = model.__tablename__.rstrip("s")
        raise NotFound(f"{noun} {name!r} does not exist", field=field or noun)
    return row


def ensure_new(s: Session, model: type[_Named], name: str, field: str = "name") -> None:
    check_name(name, field)
    if s.execute(select(model.id).where(model.name == name)).first() is not None:
        noun = model.__tablename__.rstrip("s")
        raise AlreadyExists(f"{noun} {name!r} already exists", field=field)


def scales_in_flight(s: Session, project_id: int) -> Usage:
    """The increase charged at admission by a project's scales still in flight (not yet committed nor
    rolled back), from each operation's admission record."""
    total = Usage()
    for (result,) in s.execute(
        select(Operation.result).where(
            Operation.project_id == project_id,
            Operation.kind == "scale",
            Operation.state.in_([st.value for st in IN_FLIGHT_OPERATION_STATES]),
        )
    ):
        dv, dm = ((result or {}).get("admitted") or {}).get("charge_delta") or (0, 0)
        total = total + Usage(max(dv, 0), max(dm, 0), 0)
    return total


def offering_data(o: Offering) -> OfferingData:
    return OfferingData(
        o.name,
        OfferingKind(o.kind),
        o.vcpus,
        o.memory_mib,
        o.min_vcpus,
        o.max_vcpus,
        o.min_memory_mib,
        o.max_memory_mib,
        o.cpu_speed_mhz,
        o.cpu_cap,
        o.dynamic_scaling,
        o.root_disk_mib,
        o.max_root_disk_mib,
    )


def quota_of(p: Project) -> Quota:
    return Quota(p.quota_vcpus, p.quota_memory_mib, p.quota_vms, p.quota_storage_mib)


def ledger_of(p: Project) -> Usage:
    return Usage(p.used_vcpus, p.used_memory_mib, p.used_vms, p.used_storage_mib)


def volume_sizes(s: Session, project_id: int) -> list[int]:
    """Each file a project's volumes have, at its volume's size: a volume's own, and each overlay of its
    snapshots' chain (issue 32: an overlay may grow to the disk's size)."""
    overlays = (
        select(VolumeFile.volume_id, func.count().label("n"))
        .where(VolumeFile.parent.is_not(None))
        .group_by(VolumeFile.volume_id)
        .subquery()
    )
    rows = s.execute(
        select(Volume.size_mib, overlays.c.n)
        .outerjoin(overlays, overlays.c.volume_id == Volume.id)
        .where(Volume.project_id == project_id)
    )
    return [size for size, n in rows for _ in range(1 + (n or 0))]


_IMAGE_PATH = re.compile(r"^/[A-Za-z0-9._/-]{1,1023}$")


def valid_image(image: str) -> bool:
    """An image is a name (vmplane's own images) or an absolute folder path; nothing that could climb
    out of it or break into domain XML."""
    if NAME_RE.match(image or ""):
        return True
    return bool(_IMAGE_PATH.match(image or "")) and ".." not in image.split("/")


_TOKEN_BY_HASH = select(Token.__table__.c.name, Token.__table__.c.role, Token.__table__.c.project_id).where(
    Token.__table__.c.token_hash == bindparam("digest")
)


# a new VM's offering and template as the store has them now (check_new_vm): every column, to compare with
# what this process cached (an id alone could be another's: SQLite reuses the highest rowid after a delete)
_O_T, _T_T = Offering.__table__, Template.__table__
_O_COLS, _T_COLS = ([c.name for c in t.columns if c.name != "retired"] for t in (_O_T, _T_T))
_NOW_DEFINED = select(
    *(_O_T.c[n].label(f"o_{n}") for n in _O_COLS),
    *(_T_T.c[n].label(f"t_{n}") for n in _T_COLS),
    _O_T.c.retired.label("o_retired"),
    _T_T.c.retired.label("t_retired"),
).where(_O_T.c.id == bindparam("o"), _T_T.c.id == bindparam("t"))
_DEFINED = {Offering: attrgetter(*_O_COLS), Template: attrgetter(*_T_COLS)}


class Outdated(Exception):
    """What this process knew of an offering or template is outdated (check_new_vm): read it again."""


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Catalog:
    def __init__(
        self,
        db: Database,
        on_settings_changed: Callable[[], None] = lambda: None,
        disk_image: Callable[[str, str], Any] | None = None,
    ):
        self.db = db
        self._disk_image = disk_image  # (template, file) -> its facts: imported (hosts.images.template_disk)
        self._on_settings_changed = on_settings_changed
        self._settings_cache: _Settings | None = None
        self._cache_lock = threading.Lock()
        # Offerings and templates never change once created, but for `retired` (read from the store by
        # check_new_vm) and deletion (forget): admissions read them from here.
        self._offerings: dict[str, Offering] = {}
        self._templates: dict[str, Template] = {}
        self._definitions: dict[Offering | Template, tuple[Any, ...]] = {}  # each cached one's columns (check_new_vm)
        self._data: dict[Offering, OfferingData] = {}  # each cached offering as plain data
        # (key, zone, cluster) -> (the settings read, the value resolved from them)
        self._effective: dict[tuple[str, str | None, str | None], tuple[_Settings, object]] = {}

    # -- zones and clusters -------------------------------------------------------------------
    def create_zone(self, name: str) -> Zone:
        with self.db.write() as s:
            ensure_new(s, Zone, name)
            zone = Zone(name=name)
            s.add(zone)
        return zone

    def zones(self) -> list[Zone]:
        with self.db.read() as s:
            return list(s.scalars(select(Zone).order_by(Zone.name)))

    def create_cluster(self, name: str, zone: str, cpu_model: str | None = None) -> Cluster:
        """`cpu_model`: its guests' CPU model (None: its hosts' baseline; controllers/clustercpu.py)."""
        why = cpumodels.check_cluster_model(cpu_model)
        if why:
            raise Invalid(why, field="cpu_model")
        with self.db.write() as s:
            ensure_new(s, Cluster, name)
            z = get_by_name(s, Zone, zone, field="zone")
            cluster = Cluster(name=name, zone_id=z.id, cpu_model=cpu_model)
            s.add(cluster)
            s.flush()
            s.refresh(cluster)
        return cluster

    def clusters(self) -> list[Cluster]:
        with self.db.read() as s:
            return list(s.scalars(select(Cluster).order_by(Cluster.name)).unique())

    # -- projects ------------------------------------------------------------------------------
    def create_project(
        self,
        name: str,
        vcpus: int,
        memory_mib: int,
        vms: int,
        count_overhead: bool = False,
        max_concurrent_migrations: int | None = None,
        storage_mib: int = DEFAULT_STORAGE_QUOTA_MIB,
        backups_mib: int = DEFAULT_STORAGE_QUOTA_MIB,
    ) -> Project:
        for field, value in (
            ("vcpus", vcpus),
            ("memory_mib", memory_mib),
            ("vms", vms),
            ("storage_mib", storage_mib),
            ("backups_mib", backups_mib),
        ):
            if value < 0:
                raise Invalid(f"quota {field} must be 0 or more, got {value}", field=field)
        if max_concurrent_migrations is not None and max_concurrent_migrations < 0:
            raise Invalid("max_concurrent_migrations must be 0 (unlimited) or more", field="max_concurrent_migrations")
        with self.db.write() as s:
            ensure_new(s, Project, name)
            p = Project(
                name=name,
                quota_vcpus=vcpus,
                quota_memory_mib=memory_mib,
                quota_vms=vms,
                count_overhead=count_overhead,
                max_concurrent_migrations=max_concurrent_migrations or None,
                quota_storage_mib=storage_mib,
                quota_backup_mib=backups_mib,
                used_backup_mib=0,
                used_vcpus=0,
                used_memory_mib=0,
                used_vms=0,
                used_storage_mib=0,
            )
            s.add(p)
        return p

    def projects(self) -> list[Project]:
        with self.db.read() as s:
            return list(s.scalars(select(Project).order_by(Project.name)))

    def project(self, name: str) -> Project:
        with self.db.read() as s:
            return get_by_name(s, Project, name, field="project")

    def set_quota(
        self,
        name: str,
        vcpus: int | None = None,
        memory_mib: int | None = None,
        vms: int | None = None,
        count_overhead: bool | None = None,
        max_concurrent_migrations: int | None = None,
        storage_mib: int | None = None,
        backups_mib: int | None = None,
    ) -> Project:
        """Change a quota. Lowering below usage is refused; changing count_overhead re-charges every
        running VM in the same transaction (and is refused if that no longer fits)."""
        for field, value in (
            ("vcpus", vcpus),
            ("memory_mib", memory_mib),
            ("vms", vms),
            ("storage_mib", storage_mib),
            ("backups_mib", backups_mib),
        ):
            if value is not None and value < 0:
                raise Invalid(f"quota {field} must be 0 or more, got {value}", field=field)
        if max_concurrent_migrations is not None and max_concurrent_migrations < 0:
            raise Invalid("max_concurrent_migrations must be 0 (unlimited) or more", field="max_concurrent_migrations")
        with self.db.write() as s:
            if count_overhead is not None:
                # a re-charge writes the project's VMs: their rows first, then the project's, the order every
                # VM's own transaction takes them in (start, stop, scale, delete); else a deadlock on PostgreSQL
                s.execute(
                    select(Vm.id)
                    .join(Project, Project.id == Vm.project_id)
                    .where(Project.name == name)
                    .order_by(Vm.id)
                    .with_for_update(of=Vm)
                )
            p = get_by_name(s, Project, name, field="project", for_update=True)
            new = Quota(
                vcpus if vcpus is not None else p.quota_vcpus,
                memory_mib if memory_mib is not None else p.quota_memory_mib,
                vms if vms is not None else p.quota_vms,
                storage_mib if storage_mib is not None else p.quota_storage_mib,
            )
            ledger = ledger_of(p)
            if count_overhead is not None and count_overhead != p.count_overhead:
                ledger = self._recharge(s, p, count_overhead)
            check_quota_change(p.name, new, ledger)
            p.quota_vcpus, p.quota_memory_mib, p.quota_vms = new.vcpus, new.memory_mib, new.vms
            p.quota_storage_mib = new.storage_mib
            if backups_mib is not None:
                if backups_mib < p.used_backup_mib:
                    raise Conflict(
                        f"project {p.name}: cannot set backups_mib quota to {backups_mib} MiB: "
                        f"{p.used_backup_mib} MiB in use",
                        field="backups_mib",
                    )
                p.quota_backup_mib = backups_mib
            if count_overhead is not None:
                p.count_overhead = count_overhead
            if max_concurrent_migrations is not None:
                p.max_concurrent_migrations = max_concurrent_migrations or None
        return p

    @staticmethod
    def _recharge(s: Session, p: Project, count_overhead: bool) -> Usage:
        vms = list(s.scalars(select(Vm).where(Vm.project_id == p.id)).unique())
        scaling = sorted(vm.name for vm in vms if vm.state == VmState.scaling.value)
        if scaling:  # its increase is charged, its size not yet changed: a re-charge now would lose it
            raise Conflict(
                f"project {p.name} has VMs being scaled ({', '.join(scaling)}); change count_overhead "
                f"once they are done",
                field="count_overhead",
            )
        for vm in vms:
            if VmState(vm.state) in CHARGED_STATES:
                charge = running_charge(Size(vm.vcpus, vm.memory_mib), vm.overhead_mib, count_overhead)
                vm.charged_vcpus, vm.charged_memory_mib = charge.vcpus, charge.memory_mib
        usage = recompute_usage(
            ((VmState(v.state), Size(v.vcpus, v.memory_mib), v.overhead_mib) for v in vms), count_overhead
        )
        p.used_vcpus, p.used_memory_mib, p.used_vms = usage.vcpus, usage.memory_mib, usage.vms
        return usage + Usage(storage_mib=p.used_storage_mib)

    def recomputed_usage(self, s: Session, p: Project) -> Usage:
        """Usage from the VMs' sizes, plus the increase each scale in flight was charged at admission
        (its VM keeps its old size until the scale commits)."""
        rows = s.execute(select(Vm.state, Vm.vcpus, Vm.memory_mib, Vm.overhead_mib).where(Vm.project_id == p.id))
        usage = recompute_usage(((VmState(st), Size(c, m), o) for st, c, m, o in rows), p.count_overhead)
        return usage + scales_in_flight(s, p.id) + storage_usage(volume_sizes(s, p.id))

    # -- offerings and templates ---------------------------------------------------------------
    def create_offering(self, data: OfferingData) -> Offering:
        check_name(data.name)
        validate_offering(data)
        why = cpumodels.check_offering_model(data.cpu_model)
        if why:
            raise Invalid(why, field="cpu_model")
        with self.db.write() as s:
            ensure_new(s, Offering, data.name)
            row = Offering(
                name=data.name,
                kind=data.kind.value,
                vcpus=data.vcpus,
                memory_mib=data.memory_mib,
                min_vcpus=data.min_vcpus,
                max_vcpus=data.max_vcpus,
                min_memory_mib=data.min_memory_mib,
                max_memory_mib=data.max_memory_mib,
                cpu_speed_mhz=data.cpu_speed_mhz,
                cpu_cap=data.cpu_cap,
                dynamic_scaling=data.dynamic_scaling,
                root_disk_mib=data.root_disk_mib,
                max_root_disk_mib=data.max_root_disk_mib,
                ha_policy=data.ha_policy,
                cpu_model=data.cpu_model,
            )
            s.add(row)
        return row

    def offerings(self) -> list[Offering]:
        with self.db.read() as s:
            return list(s.scalars(select(Offering).order_by(Offering.name)))

    def for_new_vm(self, offering: str, template: str) -> tuple[Offering, Template]:
        """The offering and template of a new VM, as this process knows them (NotFound if neither it nor
        the store does). Another process may have retired or deleted them since: the admission checks
        them in its own transaction (check_new_vm)."""
        return self.offering(offering), self.template(template)

    def check_new_vm(self, conn: Connection, o: Offering, t: Template) -> None:
        """In a new VM's admission transaction: both must still exist and not be retired (read from the store
        in one small query). Outdated (and both forgotten) if either was deleted meanwhile, or differs from
        what this process cached (deleted and made again): the caller reads them again (NotFound, or the one
        made since under that name)."""
        row = once_per_transaction(
            conn,
            (_NOW_DEFINED, o.id, t.id),  # (once per admission batch)
            lambda: prepared(self.db.engine, _NOW_DEFINED).row_in(conn, o=o.id, t=t.id),
        )
        if row is None or row[:-2] != self._defined(o) + self._defined(t):
            self.forget(o.name, t.name)
            raise Outdated(f"offering {o.name} or template {t.name} changed while a VM was admitted")
        for noun, name, retired in (("offering", o.name, row.o_retired), ("template", t.name, row.t_retired)):
            if retired:
                raise Conflict(f"{noun} {name} is retired: it takes no new VMs (VMs using it keep it)", field=noun)

    def forget(self, offering: str | None = None, template: str | None = None) -> None:
        """Drop cached offerings and templates that were retired or deleted."""
        cached_offering = self._offerings.pop(offering or "", None)
        if cached_offering is not None:
            self._definitions.pop(cached_offering, None)
            self._data.pop(cached_offering, None)
        cached_template = self._templates.pop(template or "", None)
        if cached_template is not None:
            self._definitions.pop(cached_template, None)

    def data_of(self, o: Offering) -> OfferingData:
        """offering_data(o), made once per cached offering (they do not change)."""
        found = self._data.get(o)
        if found is None:
            found = self._data[o] = offering_data(o)
        return found

    def _defined(self, cached: Offering | Template) -> tuple[Any, ...]:
        """A cached offering's or template's columns (but `retired`), as _NOW_DEFINED reads them."""
        found = self._definitions.get(cached)
        if found is None:
            found = self._definitions[cached] = _DEFINED[type(cached)](cached)
        return found

    def retire(self, model: type[_Immutable], name: str) -> _Immutable:
        """Retire an offering or a template: no new VMs; VMs using it keep it. Retiring twice is a 409."""
        noun = model.__tablename__.rstrip("s")
        with self.db.write() as s:
            row = get_by_name(s, model, name, field=noun, for_update=True)
            if row.retired:
                raise Conflict(f"{noun} {name} is already retired", field=noun)
            row.retired = True
        self.forget(**{noun: name})
        return row

    def _immutable(self, cache: dict[str, _Immutable], model: type[_Immutable], name: str, field: str) -> _Immutable:
        found = cache.get(name)
        if found is None:
            with self.db.read() as s:
                found = cache[name] = get_by_name(s, model, name, field=field)
        return found

    def offering(self, name: str) -> Offering:
        return self._immutable(self._offerings, Offering, name, "offering")

    def offering_by_id(self, offering_id: int) -> Offering:
        with self.db.read() as s:
            found = s.get(Offering, offering_id)
        if found is None:
            raise NotFound(f"offering #{offering_id} does not exist", field="offering")
        return found

    def create_template(
        self,
        name: str,
        image: str | None,
        dynamic_scaling: bool = False,
        disk: str | None = None,
        from_image: str | None = None,
    ) -> Template:
        """A template boots a kernel image (`image`: tiny-linux or a folder with vmlinuz + initrd.gz), with
        a root disk when `disk` names one (tiny-linux: the test guest's; or an image file, imported), or
        boots a disk image file as it is (`image` an image file: imported, no kernel; or `from_image`, an
        uploaded image)."""
        if from_image is not None:
            if image is not None or disk is not None:
                raise Invalid("give from_image (an uploaded image) or image and disk, not both", field="from_image")
            return self._template_from_image(name, from_image, dynamic_scaling)
        if image is None:
            raise Invalid("a template needs an image, or from_image (an uploaded image)", field="image")
        for field, value in (("image", image), ("disk", disk)):
            if value is not None and not valid_image(value):
                raise Invalid(
                    f"{field} must be an image name (like tiny-linux) or an absolute path of letters, "
                    f"digits, '.', '_', '-' and '/', without '..'",
                    field=field,
                )
        if image.startswith("/") and not os.path.exists(image):
            raise Invalid(
                f"image {image} does not exist on the control plane (give a disk image file, or a "
                f"folder with vmlinuz and initrd.gz)",
                field="image",
            )
        if image.startswith("/") and os.path.isfile(image):
            if disk is not None:
                raise Invalid(
                    "a disk image template boots its image: give --disk only with a kernel image", field="disk"
                )
            image, disk = "", image
        check_name(name)
        with self.db.read() as s:
            ensure_new(s, Template, name)
        facts = None
        if disk is not None:
            if self._disk_image is None:
                raise Invalid("this control plane imports no disk images", field="disk")
            facts = self._disk_image(name, disk)
        with self.db.write() as s:
            ensure_new(s, Template, name)
            row = Template(
                name=name,
                image=image,
                dynamically_scalable=dynamic_scaling,
                disk_image=facts.path if facts else None,
                disk_format=facts.format if facts else None,
                disk_mib=facts.virtual_mib if facts else None,
                checksum=facts.checksum if facts else None,
            )
            s.add(row)
        return row

    def _template_from_image(self, name: str, image: str, dynamic_scaling: bool) -> Template:
        """A template whose VMs boot the uploaded image (their root disks: overlays on its file). Its row is
        locked meanwhile, so that the image is not deleted under the new template."""
        check_name(name)
        with self.db.write() as s:
            ensure_new(s, Template, name)
            try:
                found = image_rows.image(s.connection(), image, for_update=True)
            except NotFound:
                raise Invalid(f"image {image!r} was not uploaded (vmplane image list)", field="from_image") from None
            row = Template(
                name=name,
                image="",
                dynamically_scalable=dynamic_scaling,
                disk_image=found.file,
                disk_format=found.format,
                disk_mib=found.virtual_mib,
                checksum=found.sha256,
            )
            s.add(row)
        return row

    def templates(self) -> list[Template]:
        with self.db.read() as s:
            return list(s.scalars(select(Template).order_by(Template.name)))

    def template(self, name: str) -> Template:
        return self._immutable(self._templates, Template, name, "template")

    # -- settings ------------------------------------------------------------------------------
    def _scope_exists(self, s: Session, scope: str, scope_name: str | None) -> str:
        if scope == "global":
            if scope_name:
                raise Invalid("global settings take no zone or cluster", field="scope")
            return ""
        if not scope_name:
            raise Invalid(f"{scope} scope needs a {scope} name", field=scope)
        get_by_name(s, Zone if scope == "zone" else Cluster, scope_name, field=scope)
        return scope_name

    def set_setting(
        self, key: str, value: object, scope: str = "global", scope_name: str | None = None
    ) -> dict[str, Any]:
        """Set a value (text, number or boolean), checked against the key's type and range before
        anything is saved; it is stored in its canonical text form."""
        text = settings_rules.setting_key(key).text(settings_rules.parse_value(key, scope, value))
        with self.db.write() as s:
            name = self._scope_exists(s, scope, scope_name)
            row = s.execute(
                select(Setting).where(Setting.key == key, Setting.scope == scope, Setting.scope_name == name)
            ).scalar_one_or_none()
            if row is None:
                s.add(Setting(key=key, scope=scope, scope_name=name, value=text))
            else:
                row.value = text
        self._settings_changed()
        return self.get_setting(key, scope, scope_name)

    def unset_setting(self, key: str, scope: str = "global", scope_name: str | None = None) -> dict[str, Any]:
        """Remove the value set at this scope: the key falls back to the inherited value. Unsetting a
        value that is not set is a 409 (the rule for every no-op)."""
        settings_rules.setting_key(key)
        with self.db.write() as s:
            name = self._scope_exists(s, scope, scope_name)
            # (a DELETE's result is a CursorResult: Session.execute is typed as returning any Result)
            gone = cast(
                CursorResult[Any],
                s.execute(
                    delete(Setting).where(Setting.key == key, Setting.scope == scope, Setting.scope_name == name)
                ),
            ).rowcount
            if not gone:
                where = "global scope" if scope == "global" else f"{scope} {name}"
                raise Conflict(f"{key} is not set at {where}; nothing to unset", field="key")
        self._settings_changed()
        return self.get_setting(key, scope, scope_name)

    def forget_settings(self) -> None:
        """Read settings from the store again at their next use (another process may have changed them)."""
        with self._cache_lock:
            self._settings_cache = None

    def _settings_changed(self) -> None:
        self.forget_settings()
        self._on_settings_changed()

    def _all_settings(self) -> _Settings:
        with self._cache_lock:
            if self._settings_cache is None:
                cache: _Settings = {}
                with self.db.read() as s:
                    for row in s.scalars(select(Setting)):
                        cache.setdefault(row.key, {})[(row.scope, row.scope_name or None)] = row.value
                self._settings_cache = cache
            return self._settings_cache

    def effective(self, key: str, zone: str | None = None, cluster: str | None = None) -> object:
        """The value of `key` that applies in a zone and cluster (remembered until settings change: each
        admission asks for several)."""
        settings = self._all_settings()
        found = self._effective.get((key, zone, cluster))
        if found is None or found[0] is not settings:
            found = (settings, settings_rules.resolve(key, settings.get(key, {}), zone=zone, cluster=cluster))
            self._effective[key, zone, cluster] = found
        return found[1]

    def get_setting(self, key: str, scope: str = "global", scope_name: str | None = None) -> dict[str, Any]:
        spec = settings_rules.setting_key(key)
        zone = cluster = None
        with self.db.read() as s:
            name = self._scope_exists(s, scope, scope_name)
            if scope == "cluster":
                cluster = name
                zone = get_by_name(s, Cluster, name, field="cluster").zone.name
            elif scope == "zone":
                zone = name
        values = self._all_settings().get(key, {})
        source = "default"
        for sc, nm in (("cluster", cluster), ("zone", zone), ("global", None)):
            if (sc == "global" or nm) and (sc, nm) in values:
                source = sc if sc == "global" else f"{sc} {nm}"
                break
        return {
            "key": key,
            "value": settings_rules.resolve(key, values, zone=zone, cluster=cluster),
            "source": source,
            "default": spec.default,
            "range": spec.range,
            "scope": scope,
            "scope_name": scope_name,
            "narrowest_scope": spec.narrowest_scope,
            "description": spec.description,
        }

    def list_settings(self) -> list[dict[str, Any]]:
        values = self._all_settings()
        out = []
        for key, spec in sorted(settings_rules.KEYS.items()):
            out.append(
                {
                    "key": key,
                    "default": spec.default,
                    "range": spec.range,
                    "narrowest_scope": spec.narrowest_scope,
                    "description": spec.description,
                    "values": [
                        {"scope": sc, "scope_name": nm, "value": settings_rules.typed(key, v)}
                        for (sc, nm), v in sorted(values.get(key, {}).items(), key=str)
                    ],
                }
            )
        return out

    # -- tokens --------------------------------------------------------------------------------
    def create_token(self, name: str, role: str = "admin", project: str | None = None, token: str | None = None) -> str:
        """Store a token (hashed) and return its clear text, which is shown once."""
        if role not in ("admin", "member"):
            raise Invalid("role must be admin or member", field="role")
        token = token or secrets.token_urlsafe(32)
        with self.db.write() as s:
            ensure_new(s, Token, name)
            if role == "admin" and project:
                raise Invalid(
                    "an admin token belongs to no project; leave out project (or use role member)", field="project"
                )
            project_id = get_by_name(s, Project, project, field="project").id if project else None
            if role == "member" and project_id is None:
                raise Invalid("a member token needs a project", field="project")
            s.add(Token(name=name, token_hash=hash_token(token), role=role, project_id=project_id))
        return token

    def ensure_admin_token(self, name: str, token: str) -> None:
        """Make `token` the admin token called `name` (used by `vmplane up` at every start)."""
        with self.db.write() as s:
            same = s.execute(select(Token).where(Token.token_hash == hash_token(token))).scalar_one_or_none()
            if same is not None:
                if same.role != "admin":
                    raise Conflict(
                        f"that token is the member token {same.name!r}; an admin token must be another secret",
                        field="token",
                    )
                return  # already an admin token (under any name): nothing to do
            row = s.execute(select(Token).where(Token.name == name)).scalar_one_or_none()
            if row is None:
                s.add(Token(name=name, token_hash=hash_token(token), role="admin"))
            else:
                row.token_hash, row.role, row.project_id = hash_token(token), "admin", None

    def authenticate(self, token: str) -> tuple[str, str, int | None]:
        """(name, role, project id) of a valid token, read from the store at every request (one
        prebuilt indexed lookup on a pooled connection: store/prepared.py), so that a token revoked by
        any process is refused at once."""
        row = prepared(self.db.engine, _TOKEN_BY_HASH).first(digest=hash_token(token))
        if row is None:
            raise Unauthorized("the bearer token is not valid")
        return row["name"], row["role"], row["project_id"]

    def token_by_hash(self, token_hash: str) -> tuple[str, str, int | None] | None:
        """(name, role, project id) of the token whose hash is `token_hash`, while it is not revoked."""
        row = prepared(self.db.engine, _TOKEN_BY_HASH).first(digest=token_hash)
        return None if row is None else (row["name"], row["role"], row["project_id"])

    def tokens(self, project_id: int | None = None) -> list[dict[str, Any]]:
        """Every token (or a project's), without its hash."""
        stmt = (
            select(Token.name, Token.role, Project.name.label("project"), Token.created_at)
            .outerjoin(Project, Project.id == Token.project_id)
            .order_by(Token.name)
        )
        if project_id is not None:
            stmt = stmt.where(Token.project_id == project_id)
        with self.db.read() as s:
            return [dict(r._mapping) for r in s.execute(stmt)]

    def revoke_token(self, name: str, project_id: int | None = None) -> None:
        """Delete a token (only among a project's tokens when `project_id` is given: a member's view).
        The last admin token can not be revoked: nobody could administer the control plane then."""
        with self.db.write() as s:
            row = s.execute(select(Token).where(Token.name == name)).scalar_one_or_none()
            if row is None or (project_id is not None and row.project_id != project_id):
                raise NotFound(f"token {name!r} does not exist", field="token")
            if row.role == "admin" and s.scalar(select(func.count()).where(Token.role == "admin")) == 1:
                raise Conflict(f"token {name} is the last admin token; create another admin token first", field="token")
            s.delete(row)

    def count(self, model: type[Base]) -> int:
        with self.db.read() as s:
            return s.scalar(select(func.count()).select_from(model)) or 0


__all__ = ["Catalog", "Host", "ensure_new", "get_by_name", "ledger_of", "offering_data", "quota_of"]
