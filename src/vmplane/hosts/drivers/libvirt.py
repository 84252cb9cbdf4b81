"""The real hypervisor driver: one libvirtd host, through libvirt-python.

libvirt does the domain XML, live vCPU and memory changes, CPU tuning and the migration protocol;
this driver maps vmplane's requests onto it and reads the guest's own view through its serial
console (virDomainOpenConsole), which works for local and remote (qemu+tls) hosts alike. Storage
(pools, volumes, a domain's disks) is in libvirtstorage.StorageMixin; migrations with storage are here
(_migration_args: copied disks and the shared-storage flag).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import logging
import os
import re
import subprocess
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from xml.etree import ElementTree

import libvirt

from vmplane.core.driver import (
    CpuCap,
    DomainInfo,
    DomainSpec,
    Driver,
    DriverError,
    GuestView,
    HostInfo,
    MigrationParams,
    MigrationStats,
    ProgressCallback,
    Resized,
    confirm_unplug,
)
from vmplane.core.guestexec import exec_lines, exec_result
from vmplane.core.hostnet import Applied, HostNetworks
from vmplane.hosts import hostnet
from vmplane.hosts.drivers.domainxml import domain_xml
from vmplane.hosts.drivers.libvirtagent import AgentMixin, AgentUnavailable
from vmplane.hosts.drivers.libvirtbackups import BackupMixin
from vmplane.hosts.drivers.libvirtblockcopy import BlockCopyMixin
from vmplane.hosts.drivers.libvirtconsole import ConsoleMixin
from vmplane.hosts.drivers.libvirtcpu import CpuMixin
from vmplane.hosts.drivers.libvirtdomains import discard_domain, is_absent, undefine
from vmplane.hosts.drivers.libvirtnics import NicMixin
from vmplane.hosts.drivers.libvirtsnapshots import CloneMixin, CommitMixin, SnapshotMixin
from vmplane.hosts.drivers.libvirtstats import StatsMixin
from vmplane.hosts.drivers.libvirtstorage import StorageMixin
from vmplane.hosts.guest import build as guest

LIVE = libvirt.VIR_DOMAIN_AFFECT_LIVE
NO_CAP = 17592186044415  # what libvirt reports (and takes) for "no CFS quota"


def _names(prefix: str) -> dict[int, str]:
    return {
        getattr(libvirt, n): n[len(prefix) :].lower().replace("_", "-") for n in dir(libvirt) if n.startswith(prefix)
    }


_STATES = {
    libvirt.VIR_DOMAIN_NOSTATE: "nostate",
    libvirt.VIR_DOMAIN_RUNNING: "running",
    libvirt.VIR_DOMAIN_BLOCKED: "blocked",
    libvirt.VIR_DOMAIN_PAUSED: "paused",
    libvirt.VIR_DOMAIN_SHUTDOWN: "shutdown",
    libvirt.VIR_DOMAIN_SHUTOFF: "shutoff",
    libvirt.VIR_DOMAIN_CRASHED: "crashed",
    libvirt.VIR_DOMAIN_PMSUSPENDED: "pmsuspended",
}
_REASONS = {
    libvirt.VIR_DOMAIN_RUNNING: _names("VIR_DOMAIN_RUNNING_"),
    libvirt.VIR_DOMAIN_PAUSED: _names("VIR_DOMAIN_PAUSED_"),
    libvirt.VIR_DOMAIN_SHUTOFF: _names("VIR_DOMAIN_SHUTOFF_"),
    libvirt.VIR_DOMAIN_CRASHED: _names("VIR_DOMAIN_CRASHED_"),
    libvirt.VIR_DOMAIN_SHUTDOWN: {0: "unknown", 1: "user"},
}


_MARK = re.compile(rb"__VMP_B(\w+)__\r?\n(.*?)__VMP_E\1_(\d+)__", re.S)


def _quiet(ctx, err):  # libvirt prints every error to stderr by default; we raise them instead
    pass


libvirt.registerErrorHandler(_quiet, None)


log = logging.getLogger("vmplane.libvirt")
OPEN_TIMEOUT_S = 10.0


def probe_words(stderr: str) -> str:
    """What `virsh -c URI uri` said when it could not connect: its error lines (not the generic "failed to
    connect to the hypervisor"), with the reason libvirt logged for a refused TLS certificate, e.g.
    "authentication failed: Failed to verify peer's certificate (The certificate hasn't got a known
    issuer.): the host's certificate is not trusted"."""
    lines = stderr.strip().splitlines()
    errors = [
        line.removeprefix("error: ")
        for line in lines
        if line.startswith("error: ") and "failed to connect to the hypervisor" not in line
    ]
    words = "; ".join(errors) or (lines[-1] if lines else "virsh failed")
    causes = [
        line.rsplit("Certificate failed validation: ", 1)[-1]
        for line in lines
        if "Certificate failed validation: " in line
    ]
    if causes:
        words += f" ({causes[0]})"
    if "certificate" in words.lower() and ("verify" in words.lower() or causes):
        words += ": the host's certificate is not trusted"
    return words


STUCK_S = 3.0
# how long a completed copy waits for libvirt's JOB_COMPLETED event (its statistics) after the call returned
JOB_COMPLETED_WAIT_S = 3.0


class _EventLoop:
    """libvirt's default event loop in a daemon thread: needed for keepalive (dead-host detection)
    and domain events; must be registered before the first connection is opened."""

    _started = False
    _lock = threading.Lock()

    @classmethod
    def ensure(cls) -> None:
        with cls._lock:
            if cls._started:
                return
            libvirt.virEventRegisterDefaultImpl()
            threading.Thread(target=cls._run, name="libvirt-events", daemon=True).start()
            cls._started = True

    @staticmethod
    def _run() -> None:
        while True:  # never ends: without it, keepalive stops for every connection and calls wait forever
            try:
                libvirt.virEventRunDefaultImpl()
            except Exception:
                log.exception("libvirt event loop")
                time.sleep(0.1)


def resolve_image(image: str) -> guest.GuestImage:
    """`tiny-linux` is vmplane's test guest (built on first use); a folder holds vmlinuz + initrd.gz."""
    if image == guest.IMAGE_NAME:
        return guest.cached_image() or guest.build()
    folder = Path(image)
    if folder.is_dir() and (folder / "vmlinuz").exists() and (folder / "initrd.gz").exists():
        return guest.GuestImage(folder / "vmlinuz", folder / "initrd.gz")
    raise DriverError("-", f"image {image!r} is neither {guest.IMAGE_NAME} nor a folder with vmlinuz and initrd.gz")


class LibvirtDriver(
    StorageMixin,
    SnapshotMixin,
    CommitMixin,
    CloneMixin,
    BlockCopyMixin,
    BackupMixin,
    NicMixin,
    AgentMixin,
    ConsoleMixin,
    StatsMixin,
    CpuMixin,
    Driver,
):
    kind = "libvirt"
    _ensure_events = staticmethod(_EventLoop.ensure)  # (for the mixins' own connections: libvirtstats.py)

    def __init__(self, host: str, uri: str, accel: str | None = None):
        super().__init__(host)
        self.uri = uri
        self._accel = accel or os.environ.get("VMPLANE_ACCEL") or None
        self._conn: libvirt.virConnect | None = None
        self._conn_lock = threading.Lock()
        self._poll_conn: libvirt.virConnect | None = None  # the guest agent poll's own (_poll_dom)
        self._poll_lock = threading.Lock()
        self._dead: list[libvirt.virConnect] = []  # connections that died, kept (see conn)
        self._quick_lock = threading.Lock()  # the domain read in flight (_quick_call)
        self._console_locks: dict[str, threading.Lock] = {}
        self._watchers: list = []  # lifecycle callbacks, registered on every connection opened
        # migrations: a cancel asked before libvirt's job exists is kept until the copy sees a job
        self._abort_lock = threading.Lock()
        self._outgoing: set[str] = set()  # domains a migrate() of this driver is sending
        self._pending_aborts: set[str] = set()

    # -- connection ----------------------------------------------------------------------------
    @property
    def conn(self) -> libvirt.virConnect:
        with self._conn_lock:
            if self._conn is None or not self._conn.isAlive():
                _EventLoop.ensure()
                if self._conn is not None:
                    # a dead connection is kept, never freed: libvirt's event loop may still hold its
                    # remote client (a keepalive close races with a free from this thread)
                    self._dead.append(self._conn)
                    self._conn = None
                self._conn = self._open()
                self._conn.setKeepAlive(5, 3)
                for callback in self._watchers:
                    self._register_watch(self._conn, callback)
            return self._conn

    def _open(self) -> libvirt.virConnect:
        """libvirt.open, but only once the daemon has answered a probe within OPEN_TIMEOUT_S. A daemon that
        accepts the socket but never answers (stopped, hung, or a network that drops packets) would hold
        libvirt.open, the caller and every other call of this driver waiting for the connection lock
        forever: keepalive only guards an open connection. The probe is `virsh uri` in a process of its
        own, killed at the deadline (a libvirt.open left hanging in a thread crashed libvirt 9.0's client
        when the daemon died under it)."""
        try:
            probe = subprocess.run(
                ["virsh", "-c", self.uri, "uri"], capture_output=True, text=True, timeout=OPEN_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            raise DriverError(
                self.host, f"cannot connect to {self.uri}: no answer within {OPEN_TIMEOUT_S:g} s"
            ) from None
        except OSError:
            probe = None  # no virsh here: open without the probe
        if probe is not None and probe.returncode != 0:
            raise DriverError(self.host, f"cannot connect to {self.uri}: {probe_words(probe.stderr)}")
        try:
            return libvirt.open(self.uri)
        except libvirt.libvirtError as exc:
            raise DriverError(self.host, f"cannot connect to {self.uri}: {exc.get_error_message()}") from None

    def watch(self, callback) -> None:
        """`callback(host, domain_name, event, detail)` for every lifecycle event of this host's domains,
        on each connection this driver opens (registered again after a reconnect). It runs in libvirt's
        event thread: it must not block."""
        with self._conn_lock:
            self._watchers.append(callback)
            if self._conn is not None:
                self._register_watch(self._conn, callback)

    def _register_watch(self, conn: libvirt.virConnect, callback) -> None:
        try:
            conn.domainEventRegisterAny(
                None,
                libvirt.VIR_DOMAIN_EVENT_ID_LIFECYCLE,
                lambda _c, dom, event, detail, _o: callback(self.host, dom.name(), event, detail),
                None,
            )
        except libvirt.libvirtError:
            pass  # a dead connection: the next one registers again

    def _call(self, what: str, fn, *args):
        try:
            return fn(*args)
        except libvirt.libvirtError as exc:
            raise DriverError(self.host, f"{what}: {exc.get_error_message()}") from None

    def _lookup(self, name: str) -> libvirt.virDomain | None:
        """The domain, or None when the host confirms it has none (VIR_ERR_NO_DOMAIN); any other
        error raises DriverError: unknown is not absent."""
        try:
            return self.conn.lookupByName(name)
        except libvirt.libvirtError as exc:
            if is_absent(exc):
                return None
            raise DriverError(self.host, f"looking up domain {name}: {exc.get_error_message()}") from None

    def _poll_dom(self, name: str) -> libvirt.virDomain:
        """The domain on the background poll's connection (the guest agent controller's), called with
        `_poll_lock` held. The poll has a connection of its own: its reads never wait on the connection the
        host monitor and the operations use. Two calls waiting on one connection when keepalive closes it and
        the daemon then dies crash libvirt 9.0's client (a SIGSEGV in the second waiter: test_ha_real's
        network cut, the poll's lookup waiting beside the monitor's read when HA fenced the frozen daemon).
        A connection that died is opened again here (probed first: `_open`), and kept, never freed."""
        conn = self._poll_conn
        if conn is None or not conn.isAlive():
            if conn is not None:
                with self._conn_lock:
                    self._dead.append(conn)
                self._poll_conn = None
            _EventLoop.ensure()
            conn = self._open()
            conn.setKeepAlive(5, 3)
            self._poll_conn = conn
        try:
            return conn.lookupByName(name)
        except libvirt.libvirtError as exc:
            raise DriverError(self.host, f"looking up domain {name}: {exc.get_error_message()}") from None

    def _dom(self, name: str) -> libvirt.virDomain:
        dom = self._lookup(name)
        if dom is None:
            raise DriverError(self.host, f"domain {name} does not exist here")
        return dom

    def _is_active(self, dom: libvirt.virDomain) -> bool:
        """Whether QEMU runs for it; a domain that vanished is not active; other errors raise."""
        try:
            return bool(dom.isActive())
        except libvirt.libvirtError as exc:
            if is_absent(exc):
                return False
            raise DriverError(self.host, f"state of {dom.name()}: {exc.get_error_message()}") from None

    def _discard(self, dom: libvirt.virDomain, what: str) -> None:
        """Destroy (if running) and undefine, then read back that the domain is gone; raises
        DriverError when it is not confirmed gone. A domain that stopped by itself meanwhile (an ACPI
        power-off completing between the check and destroy()) is no failure."""
        name = dom.name()
        if self._is_active(dom):
            try:
                dom.destroy()
            except libvirt.libvirtError as exc:
                if not is_absent(exc) and self._is_active(dom):
                    raise DriverError(self.host, f"{what}: destroy {name}: {exc.get_error_message()}") from None
        try:
            undefine(dom)
        except libvirt.libvirtError as exc:
            # a transient domain (no definition left) is gone once destroyed: NO_DOMAIN either way
            if not is_absent(exc) and self._lookup(name) is not None:
                raise DriverError(self.host, f"{what}: undefine {name}: {exc.get_error_message()}") from None
        left = self._lookup(name)
        if left is not None:
            raise DriverError(
                self.host,
                f"{what}: domain {name} is still there "
                f"({'running' if self._is_active(left) else 'defined'}) after destroy and undefine",
            )

    def close(self) -> None:
        self._close_stats()
        with self._poll_lock:
            if self._poll_conn is not None:
                self._let_go(self._poll_conn)
                self._poll_conn = None
        with self._conn_lock:
            if self._conn is not None:
                try:
                    self._conn.close()
                except libvirt.libvirtError:
                    pass
                self._conn = None

    # -- host ----------------------------------------------------------------------------------
    def host_info(self) -> HostInfo:
        _model, _numa_mb, cpus, mhz, *_ = self._call("getInfo", self.conn.getInfo)
        # getInfo() sums NUMA nodes, which some virtual machines under-report; the kernel's total is right
        stats = self._call("memory stats", self.conn.getMemoryStats, libvirt.VIR_NODE_MEMORY_STATS_ALL_CELLS)
        return HostInfo(cores=cpus, cpu_mhz=mhz, memory_mib=stats["total"] // 1024)

    @property
    def accel(self) -> str:
        if self._accel is None:
            self._accel = probe_accel(self)
        return self._accel

    # -- lifecycle -----------------------------------------------------------------------------
    def domain_xml(self, spec: DomainSpec, accel: str | None = None) -> str:
        try:
            if spec.image == "":  # a bootable disk image: boots from the first disk
                return domain_xml(spec, None, None, None, accel or self.accel)
            image = resolve_image(spec.image)
            return domain_xml(spec, str(image.kernel), str(image.initrd), image.cmdline, accel or self.accel)
        except ValueError as exc:
            raise DriverError(self.host, f"domain {spec.name}: {exc}") from None

    def start(self, spec: DomainSpec) -> None:
        xml = self.domain_xml(spec)
        old = self._lookup(spec.name)
        if old is not None:
            if self._is_active(old):
                raise DriverError(self.host, f"domain {spec.name} is already running")
            self._call("undefine stale definition", old.undefineFlags, 0)
        dom = self._call("define", self.conn.defineXML, xml)
        try:
            self._call("start", dom.create)
        except DriverError as exc:
            # create() may have failed on the client side only (a dropped connection while QEMU starts):
            # the domain is gone only once the host says so; else the error says it may run
            try:
                self._discard(dom, "clean up after a failed start")
            except DriverError as left:
                raise DriverError(self.host, f"{exc}; and the domain may still exist: {left}") from None
            raise

    def stop(self, name: str, timeout_s: float = 0.0) -> str | None:
        """Ask the guest to power off for up to `timeout_s` (through its guest agent when it answers, which
        works for a guest that ignores ACPI; else ACPI), then destroy; undefine either way. How it went."""
        dom = self._lookup(name)
        if dom is None:
            return None  # the host says it has no such domain: stopping is idempotent
        how = "forced off"
        if self._is_active(dom) and timeout_s > 0:
            asked = self._ask_power_off(dom)
            deadline = time.monotonic() + timeout_s
            while self._is_active(dom) and time.monotonic() < deadline:
                time.sleep(0.2)
            if self._is_active(dom):
                how = f"forced off: the guest did not power off within {timeout_s:g} s (asked through {asked})"
            else:
                how = f"the guest powered off (asked through {asked})"
        self._discard(dom, "stop")  # returns only once the host confirms the domain gone
        return how

    def reboot(self, name: str, force: bool = False) -> str:
        dom = self._lookup(name)
        if dom is None or not self._is_active(dom):
            raise DriverError(self.host, f"domain {name} is not running here")
        if force:
            self._call(f"reset {name}", dom.reset, 0)
            return "reset (forced)"
        for flag, way in (
            (libvirt.VIR_DOMAIN_REBOOT_GUEST_AGENT, "its guest agent"),
            (libvirt.VIR_DOMAIN_REBOOT_ACPI_POWER_BTN, "ACPI"),
        ):
            try:
                dom.reboot(flag)
                return f"asked through {way}"
            except libvirt.libvirtError:
                continue
        raise DriverError(
            self.host, f"reboot {name}: neither its guest agent nor ACPI took the request (--force resets)"
        )

    def _ask_power_off(self, dom) -> str:
        """Ask the guest to power off: its guest agent (`guest-shutdown`) first, else ACPI; which one took it."""
        for flag, way in (
            (libvirt.VIR_DOMAIN_SHUTDOWN_GUEST_AGENT, "its guest agent"),
            (libvirt.VIR_DOMAIN_SHUTDOWN_ACPI_POWER_BTN, "ACPI"),
        ):
            try:
                dom.shutdownFlags(flag)
                return way
            except libvirt.libvirtError:
                continue
        return "nothing: neither its guest agent nor ACPI took the request"

    def undefine_if_shut_off(self, name: str) -> bool:
        """Undefine a domain that is shut off now; never destroys. A start that slips in between the check
        and the undefine is not stopped by it (libvirt only makes a running domain transient); its
        definition is then put back, so it keeps its run and its persistence."""
        dom = self._lookup(name)
        if dom is None:
            return True
        if self._is_active(dom):
            return False
        try:
            undefine(dom)
        except libvirt.libvirtError as exc:
            if not is_absent(exc):
                raise DriverError(self.host, f"undefine {name}: {exc.get_error_message()}") from None
        if not self._is_active(dom):
            return True
        self._call(
            f"define {name} again (it was started meanwhile)",
            self.conn.defineXML,
            self._call(f"read {name}", dom.XMLDesc, libvirt.VIR_DOMAIN_XML_INACTIVE),
        )
        return False

    def domains(self) -> list[DomainInfo]:
        with self._quick_call("list domains"):
            infos = (self._info_if_present(d) for d in self._call("list domains", self.conn.listAllDomains))
            return [info for info in infos if info is not None]

    def domain(self, name: str) -> DomainInfo | None:
        with self._quick_call(f"look up {name}"):
            dom = self._lookup(name)
            return None if dom is None else self._info_if_present(dom)

    @contextlib.contextmanager
    def _quick_call(self, what: str):
        """Reading domains takes milliseconds: one such read at a time per host. A read waits up to STUCK_S
        for the one in flight, then fails instead of joining it on the connection: two calls waiting on one
        connection when keepalive closes it and the daemon then dies crash libvirt 9.0's client (SIGSEGV
        in the second waiter: tests/test_ha_real.py caught it with faulthandler, the full sync's read
        joining the monitor's probe of a frozen daemon that HA then fenced)."""
        if not self._quick_lock.acquire(timeout=STUCK_S):
            raise DriverError(self.host, f"{what}: the daemon has not answered a read for {STUCK_S:g} s")
        try:
            yield
        finally:
            self._quick_lock.release()

    def _info_if_present(self, dom: libvirt.virDomain) -> DomainInfo | None:
        """A domain can go between two calls (a migration completes, a guest is destroyed)."""
        try:
            return self._info(dom)
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                return None
            raise DriverError(self.host, f"reading domain {dom.name()}: {exc.get_error_message()}") from None

    def _info(self, dom: libvirt.virDomain) -> DomainInfo:
        state, _max_kib, mem_kib, vcpus, _cpu = dom.info()
        reason = ""
        if state != libvirt.VIR_DOMAIN_RUNNING:  # one more small RPC, only for the unusual states
            state, why = dom.state()
            reason = _REASONS.get(state, {}).get(why, str(why))
        running = state in (libvirt.VIR_DOMAIN_RUNNING, libvirt.VIR_DOMAIN_BLOCKED)  # PAUSED is not running
        cap = soft_vcpus = None
        if state in (libvirt.VIR_DOMAIN_RUNNING, libvirt.VIR_DOMAIN_PAUSED, libvirt.VIR_DOMAIN_BLOCKED):
            try:
                params = dom.schedulerParametersFlags(LIVE)
            except libvirt.libvirtError as exc:
                if is_absent(exc):
                    raise
                params = {}  # no CPU cgroup for this domain: no cap can be read (or set)
            quota, period = params.get("vcpu_quota", -1), params.get("vcpu_period", 0)
            if 0 < quota < 17592186044415:
                cap = CpuCap(period_us=period, quota_us=quota)
            g_quota, g_period = params.get("global_quota", -1), params.get("global_period", 0)
            if 0 < g_quota < 17592186044415 and g_period > 0 and g_quota % g_period == 0:
                soft_vcpus = g_quota // g_period  # a soft scale-down's whole-domain cap, in CPUs
        return DomainInfo(
            dom.name(),
            running,
            vcpus,
            mem_kib // 1024,
            cap,
            soft_vcpus=soft_vcpus,
            state=_STATES.get(state, str(state)),
            reason=reason,
        )

    def _resized(self, dom: libvirt.virDomain, method: str) -> Resized:
        """Read the domain back after a change."""
        try:
            return Resized.of(method, self._info(dom))
        except libvirt.libvirtError as exc:
            raise DriverError(
                self.host, f"reading {dom.name()} back after the change ({method}): {exc.get_error_message()}"
            ) from None

    # -- live changes --------------------------------------------------------------------------
    # Safe vCPU unplug needs KVM: QEMU 7.2 under TCG never completes it and a later plug crashes QEMU.
    # Decided by the domain's own <domain type=...>, not by this driver's accel (it may have been
    # started by another control plane, or before VMPLANE_ACCEL changed).
    UNPLUG_SAFE_ACCELS = ("kvm",)
    UNPLUG_TRIES = 3  # DIMM unplug requests before giving up
    UNPLUG_WAIT_S = 5.0  # per request (libvirt itself waits up to 5 s inside detach)
    GROW_WAIT_S = 30.0  # for the guest to show a hot-plugged DIMM (balloon stats every 5 s)

    def set_vcpus(self, name: str, vcpus: int) -> Resized:
        """Plug vCPUs up to `vcpus`, or lower the count: by unplug where that is safe, else softly (the
        guest offlines the extra vCPUs, which stay plugged, and a whole-domain CPU cap holds it to
        `vcpus` CPUs); a later increase onlines soft-offlined vCPUs first. Returns the domain read back."""
        dom = self._dom(name)
        plugged = self._call("read the vCPU count", dom.vcpusFlags, LIVE)
        online = self._online_vcpus(name)
        capped = self._domain_cap_cpus(dom)
        if vcpus == online and vcpus == plugged and (capped is None or capped >= vcpus):
            return self._resized(dom, "unchanged")
        if vcpus == online and vcpus == plugged:  # a soft cap left below what runs (a failed soft step)
            self._set_domain_cap(dom, None)
            return self._resized(dom, "uncapped")
        if vcpus > online:
            return self._resized(dom, self._vcpus_up(dom, name, vcpus, plugged, online))
        if self._domain_type(dom) in self.UNPLUG_SAFE_ACCELS and online == plugged:
            return self._resized(dom, self._vcpus_unplug(dom, name, vcpus))
        extra = [f"cpu{i}" for i in range(vcpus, plugged)]
        self._offline(name, extra)
        self._set_domain_cap(dom, vcpus)
        self._wait_online(name, vcpus, keep_off=extra)
        return self._resized(dom, "soft")

    def _vcpus_up(self, dom, name: str, vcpus: int, plugged: int, online: int) -> str:
        """Online soft-offlined vCPUs (up to `vcpus`), then hot-plug the rest. The whole-domain cap rises
        to the new count before the guest onlines (never above it) and is put back in a finally if the
        guest does not come up: the guest never uses more than it is charged for."""
        method, done, keep_off = [], False, []
        old_cap = self._domain_cap_cpus(dom)
        try:
            if online < plugged:
                back = min(vcpus, plugged)
                self._set_domain_cap(dom, back if back < plugged else None)
                keep_off = [f"cpu{i}" for i in range(back, plugged)]
                self.guest_run(
                    name,
                    f"{self._offline_list(keep_off)}; for c in "
                    f"{' '.join(f'cpu{i}' for i in range(1, back))}; do "
                    f"echo 1 > /sys/devices/system/cpu/$c/online; done",
                    30,
                )
                method.append("online")
            if vcpus > plugged:
                self._call(f"set {vcpus} vCPUs", dom.setVcpusFlags, vcpus, LIVE)
                method.append("hotplug")
            self._wait_online(name, vcpus, keep_off=keep_off)
            done = True
        finally:
            if not done and old_cap is not None:
                try:
                    self._set_domain_cap(dom, old_cap)
                except DriverError:
                    pass  # the read-back after the failure reports what the cap is
        return "+".join(method)

    def _vcpus_unplug(self, dom, name: str, vcpus: int) -> str:
        """A real unplug; libvirt times out (VIR_ERR_OPERATION_TIMEOUT) while QEMU may still complete it:
        then wait a little and let the read-back say what happened."""
        try:
            dom.setVcpusFlags(vcpus, LIVE)
        except libvirt.libvirtError as exc:
            if exc.get_error_code() != libvirt.VIR_ERR_OPERATION_TIMEOUT:
                raise DriverError(self.host, f"unplug to {vcpus} vCPUs: {exc.get_error_message()}") from None
            deadline = time.monotonic() + 10
            while self._call("read the vCPU count", dom.vcpusFlags, LIVE) > vcpus and time.monotonic() < deadline:
                time.sleep(0.2)
        return "unplug"

    def _domain_type(self, dom) -> str:
        return ElementTree.fromstring(self._call("read the live XML", dom.XMLDesc, 0)).get("type", "")

    def _domain_cap_cpus(self, dom) -> int | None:
        try:
            params = dom.schedulerParametersFlags(LIVE)
        except libvirt.libvirtError:
            return None
        quota, period = params.get("global_quota", -1), params.get("global_period", 0)
        return quota // period if 0 < quota < NO_CAP and period else None

    def _online_vcpus(self, name: str, want: int | None = None) -> int:
        """vCPUs online in the guest; with `want`, a hot-plugged one the guest keeps offline is onlined
        through the agent (`guest-set-vcpus`): no console round trip, no wait for the guest's own onliner."""
        try:
            return self.agent_online_vcpus(name, want)
        except AgentUnavailable:
            out = self.console_run(name, "cat /sys/devices/system/cpu/online", 30)[0]
            return count_cpu_list(out.strip().splitlines()[-1])

    @staticmethod
    def _offline_list(cpus: list[str]) -> str:
        """Guest shell: list the vCPUs the guest's onliner (guest/init.sh) must leave offline; written aside
        and renamed, so that the onliner never reads a half-written (empty) list."""
        if not cpus:
            return "rm -f /run/vmplane-offline"
        return (
            f"printf '%s\\n' {' '.join(cpus)} > /run/vmplane-offline.new && "
            "mv /run/vmplane-offline.new /run/vmplane-offline"
        )

    def _offline(self, name: str, cpus: list[str]) -> tuple[int, int]:
        """One console round trip: list `cpus` for the guest's onliner, offline those of them still online;
        (vCPUs online afterwards, how many of `cpus` had to be offlined). Safe to repeat."""
        out = self.guest_exec(
            name,
            f"{self._offline_list(cpus)}; n=0; for c in {' '.join(cpus)}; do "
            "f=/sys/devices/system/cpu/$c/online; "
            '[ "$(cat $f 2>/dev/null)" = 1 ] || continue; '
            "echo 0 > $f 2>/dev/null; n=$((n+1)); done; echo $n; "
            "cat /sys/devices/system/cpu/online",
            60,
        )
        offlined, online = out.strip().splitlines()[-2:]
        return count_cpu_list(online), int(offlined)

    # Each look is a console round trip (seconds on a loaded machine) and a TCG guest offlines a vCPU
    # under stop_machine: a bound for a slow machine, not a speed expected
    VCPU_WAIT_S = 180.0

    def _wait_online(self, name: str, vcpus: int, keep_off: Sequence[str] = (), timeout_s: float | None = None) -> None:
        """Until the guest shows `vcpus` vCPUs online. With `keep_off`, each look offlines again those of
        them found online: the guest's onliner (a loop every 0.2 s) may have read the list just before it
        was written and onlined one after it was offlined (once: its next read finds the list). Done at a
        look that finds `vcpus` online with nothing left to offline, a round trip after the last offline."""
        deadline = time.monotonic() + (self.VCPU_WAIT_S if timeout_s is None else timeout_s)
        while True:
            online, offlined = self._offline(name, list(keep_off)) if keep_off else (self._online_vcpus(name, vcpus), 0)
            if online == vcpus and not offlined:
                return
            if time.monotonic() > deadline:
                again = f" ({offlined} of {' '.join(keep_off)} came online again)" if offlined else ""
                raise DriverError(self.host, f"the guest shows {online} vCPUs online, not {vcpus}{again}")
            time.sleep(0.2)

    def _set_domain_cap(self, dom, cpus: int | None) -> None:
        """A whole-domain CFS cap of `cpus` CPUs (None removes it). cgroup v1 refuses a vCPU ratio above the
        domain's, so a per-vCPU cap stays within it (it is at most one CPU per vCPU)."""
        period = 100000
        params = (
            {"global_period": period, "global_quota": NO_CAP}
            if cpus is None
            else {"global_period": period, "global_quota": cpus * period}
        )
        self._call("set the domain's CPU cap", dom.setSchedulerParametersFlags, params, LIVE)

    def set_memory(self, name: str, memory_mib: int) -> Resized:
        """Grow by hot-plugging a DIMM of the difference, confirmed in the guest; shrink by unplugging
        the newest DIMMs that add up to the decrease (the guest migrates their pages away: its kernel
        onlines hot-added memory as movable), each confirmed gone from the domain (DEVICE_REMOVED or
        the live XML), asked again a few times, else DriverError naming the DIMM. Memory below what the
        domain booted with can not be released live. Returns the domain read back."""
        dom = self._dom(name)
        current_mib = self._call("read the domain", dom.info)[2] // 1024
        if memory_mib == current_mib:
            return self._resized(dom, "unchanged")
        if memory_mib > current_mib:
            size = memory_mib - current_mib
            before = self._guest_memtotal_kib(dom)
            dimm = f"<memory model='dimm'><target><size unit='MiB'>{size}</size><node>0</node></target></memory>"
            self._call(f"attach {size} MiB DIMM", dom.attachDeviceFlags, dimm, LIVE)
            self._confirm_grown(dom, current_mib, size, before)
            return self._resized(dom, "dimm")
        release = current_mib - memory_mib
        dimms = self._dimms(dom)
        picked = dimms_to_release([d[2] for d in dimms], release)
        chosen = [dimms[i] for i in picked or ()]
        if picked is None:
            plugged = sum(d[2] for d in dimms)
            raise DriverError(
                self.host,
                f"the guest can not release {release} MiB live: only hot-plugged DIMMs can "
                f"be removed ({plugged} MiB plugged); stop and restart it smaller",
            )
        for xml, alias, size_mib in chosen:
            self._unplug_dimm(dom, xml, alias, size_mib)
        return self._resized(dom, "dimm-unplug")

    def _dimms(self, dom) -> list[tuple[str, str, int]]:
        """(device XML, alias, MiB) of the domain's DIMMs, oldest first, from the live XML."""
        out = []
        for xml in re.findall(
            r"(<memory model='dimm'.*?</memory>)", self._call("read the live XML", dom.XMLDesc, 0), re.S
        ):
            alias = re.search(r"<alias name='([^']+)'", xml)
            size = re.search(r"<size unit='KiB'>(\d+)</size>", xml)
            assert size is not None  # (libvirt writes every DIMM's size)
            out.append((xml, alias.group(1) if alias else "?", int(size.group(1)) // 1024))
        return out

    def _unplug_dimm(self, dom, xml: str, alias: str, size_mib: int) -> None:
        self._unplug_device(
            dom,
            xml,
            alias,
            f"DIMM {alias} ({size_mib} MiB)",
            lambda: any(a == alias for _, a, _ in self._dimms(dom)),
            self.UNPLUG_TRIES,
            self.UNPLUG_WAIT_S,
        )

    def _unplug_device(self, dom, xml: str, alias: str, what: str, still_there, tries: int, wait_s: float) -> None:
        """Ask for a device's removal and wait until it is gone: libvirt's DEVICE_REMOVED event for its
        alias, or `still_there()` false (the live XML, polled). libvirt's detach returns success once it
        has only *sent* the request; the guest may complete it later or never (a DIMM, a disk)."""
        removed = threading.Event()

        def on_removed(_conn, _dom, dev_alias, _opaque):
            if dev_alias == alias:
                removed.set()

        try:
            callback = self.conn.domainEventRegisterAny(
                dom, libvirt.VIR_DOMAIN_EVENT_ID_DEVICE_REMOVED, on_removed, None
            )
        except libvirt.libvirtError:
            callback = None  # the live XML alone tells

        def request() -> str | None:
            try:
                dom.detachDeviceFlags(xml, LIVE)
            except libvirt.libvirtError as exc:
                if is_absent(exc):
                    raise DriverError(self.host, f"domain {dom.name()} went away during the unplug of {what}") from None
                return exc.get_error_message()  # e.g. an unplug still pending: wait for it
            return None

        try:
            confirm_unplug(
                self.host, what, request, lambda: removed.is_set() or not still_there(), tries, wait_s, removed.wait
            )
        finally:
            if callback is not None:
                try:
                    self.conn.domainEventDeregisterAny(callback)
                except libvirt.libvirtError:
                    pass

    def _guest_memtotal_kib(self, dom) -> int | None:
        """The guest's MemTotal through the balloon's stats (None while the guest has no balloon driver)."""
        try:
            return dom.memoryStats().get("available")
        except libvirt.libvirtError:
            return None

    def _confirm_grown(self, dom, old_mib: int, size_mib: int, before_kib: int | None) -> None:
        """A DIMM attached is an effect once the domain has it and, when the guest reports its memory,
        once the guest's MemTotal grew by (nearly) the DIMM: a guest that does not online hot-added
        memory holds it unused (the tenant would pay for memory it can not use)."""
        deadline = time.monotonic() + self.GROW_WAIT_S
        while (now_mib := self._call("read the domain", dom.info)[2] // 1024) < old_mib + size_mib:
            if time.monotonic() > deadline:
                raise DriverError(
                    self.host,
                    f"the domain shows {now_mib} MiB after a {size_mib} MiB DIMM was "
                    f"attached, not {old_mib + size_mib}",
                )
            time.sleep(0.2)
        if before_kib is None:
            return  # no balloon stats yet (the guest boots): it enumerates the DIMM as it comes up
        want = before_kib + size_mib * 1024 * 9 // 10
        while (seen := self._guest_memtotal_kib(dom) or 0) < want:
            if time.monotonic() > deadline:
                raise DriverError(
                    self.host,
                    f"the guest did not take the {size_mib} MiB DIMM: its MemTotal stayed "
                    f"at {seen // 1024} MiB (was {before_kib // 1024} MiB)",
                )
            time.sleep(0.5)

    def set_cpu_cap(self, name: str, cap: CpuCap | None) -> Resized:
        dom = self._dom(name)
        params = {"vcpu_quota": -1} if cap is None else {"vcpu_period": cap.period_us, "vcpu_quota": cap.quota_us}
        self._call("set CPU cap", dom.setSchedulerParametersFlags, params, LIVE)
        return self._resized(dom, "cap")

    handles_timeout = True  # migrate() keeps params.timeout_s itself (switch to post-copy or abort)

    def _migration_args(self, target: LibvirtDriver, params: MigrationParams) -> tuple[int, dict]:
        flags = (
            libvirt.VIR_MIGRATE_LIVE
            | libvirt.VIR_MIGRATE_PEER2PEER
            | libvirt.VIR_MIGRATE_PERSIST_DEST
            | libvirt.VIR_MIGRATE_UNDEFINE_SOURCE
        )
        mparams: dict = {libvirt.VIR_MIGRATE_PARAM_URI: f"tcp://{target.incoming_address()}"}
        if params.bandwidth_mib_s:
            mparams[libvirt.VIR_MIGRATE_PARAM_BANDWIDTH] = params.bandwidth_mib_s
        if params.postcopy:
            flags |= libvirt.VIR_MIGRATE_POSTCOPY
            if params.postcopy_bandwidth_mib_s:
                mparams[libvirt.VIR_MIGRATE_PARAM_BANDWIDTH_POSTCOPY] = params.postcopy_bandwidth_mib_s
        if params.auto_converge:
            flags |= libvirt.VIR_MIGRATE_AUTO_CONVERGE
        if params.parallel_connections:
            flags |= libvirt.VIR_MIGRATE_PARALLEL
            mparams[libvirt.VIR_MIGRATE_PARAM_PARALLEL_CONNECTIONS] = params.parallel_connections
        if params.copy_disks:
            # Copy these disks' data with the memory: libvirt starts an NBD server in the target QEMU
            # and drive-mirrors each listed disk into it before (and while) memory moves. INC copies
            # only the overlay's own clusters (the backing image must be on the target already), and
            # libvirt does not create the target file for INC: the caller made the overlay there, at
            # the same path ("pre-creation of storage targets for incremental storage migration is
            # not supported" otherwise). DISKS_URI says where the NBD server listens and the source
            # connects: the target's migration address, as for the memory stream. libvirt 9 does the
            # same without it when the target's qemu.conf sets migration_address (checked: a copy
            # between two hosts in their own network namespaces works either way), but a target
            # listening on 0.0.0.0 would then be reached at the address the source resolves for it.
            flags |= libvirt.VIR_MIGRATE_NON_SHARED_INC
            mparams[libvirt.VIR_MIGRATE_PARAM_MIGRATE_DISKS] = list(params.copy_disks)
            mparams[libvirt.VIR_MIGRATE_PARAM_DISKS_URI] = f"tcp://{target.incoming_address()}"
        if params.shared_disks:
            # libvirt's own safety check (qemuMigrationSrcIsSafe, src/qemu/qemu_migration.c) refuses
            # every writable file disk that is not copied unless statfs() of its path reports a
            # shared or cluster file system it knows (virFileIsSharedFS / virFileIsClusterFS: NFS,
            # GFS2, OCFS2, CIFS/SMB, Ceph, GPFS, Lustre, BeeGFS, ...): "Migration without shared
            # storage is unsafe". The cache mode only matters after that test (cache=none/directsync,
            # or a QEMU that drops its caches, as 7.2 does). A shared pool here is an ext4 folder
            # bind-mounted into every host's namespace (the model of an NFS export): really shared,
            # but ext4 to statfs, so libvirt can not know. vmplane checked that every other disk is
            # on a pool all hosts share, and the lock manager (lockd) still forbids two writers:
            # VIR_MIGRATE_UNSAFE only skips that file-system-type test.
            flags |= libvirt.VIR_MIGRATE_UNSAFE
        return flags, mparams

    def migrate(
        self, name: str, target: Driver, params: MigrationParams, progress: ProgressCallback | None = None
    ) -> MigrationStats:
        """Peer-to-peer live migration to `target` (libvirt carries hot-plugged vCPUs and DIMMs along).

        The call runs in a thread; this one polls jobStats() for progress (it can block ~0.7 s), switches
        to post-copy `postcopy_after_s` after the first pass starts, aborts the job once it exists if a
        cancel came before it did, and keeps the deadline `timeout_s` (still in pre-copy then: switch to
        post-copy when `timeout_action` says so, else abort; a post-copy is left to complete). An error
        says nothing of where the domain is: the caller asks both hosts."""
        with self._abort_lock:
            self._outgoing.add(name)  # from now on a cancel is kept until the job exists
        try:
            if not isinstance(target, LibvirtDriver):
                raise DriverError(self.host, "a libvirt host can only migrate to another libvirt host")
            dom = self._dom(name)
            flags, mparams = self._migration_args(target, params)
            if params.max_downtime_ms:
                self._call("set max downtime", dom.migrateSetMaxDowntime, params.max_downtime_ms, 0)
            return self._copy(dom, name, target, params, flags, mparams, progress)
        finally:
            with self._abort_lock:
                self._outgoing.discard(name)
                self._pending_aborts.discard(name)

    def _take_pending_abort(self, name: str) -> bool:
        with self._abort_lock:
            pending = name in self._pending_aborts
            self._pending_aborts.discard(name)
            return pending

    def _copy(
        self,
        dom,
        name: str,
        target: LibvirtDriver,
        params: MigrationParams,
        flags: int,
        mparams: dict,
        progress: ProgressCallback | None,
    ) -> MigrationStats:
        completed: dict = {}
        arrived = threading.Event()

        def on_completed(_conn, _dom, stats, _opaque):
            completed.update(stats)
            arrived.set()

        callback = self.conn.domainEventRegisterAny(dom, libvirt.VIR_DOMAIN_EVENT_ID_JOB_COMPLETED, on_completed, None)
        outcome: dict = {}

        def copy():
            try:
                dom.migrateToURI3(target.p2p_uri(), mparams, flags)
                outcome["ok"] = True
            except libvirt.libvirtError as exc:
                outcome["error"] = exc.get_error_message()

        t0 = time.monotonic()
        watch = _CopyWatch(self, dom, name, params, progress, t0)
        try:
            if self._take_pending_abort(name):  # right before the job is created
                raise DriverError(
                    self.host, f"migration of {name} cancelled before the copy started; it keeps running here"
                )
            worker = threading.Thread(target=copy, name=f"migrate-{name}", daemon=True)
            worker.start()
            try:
                while worker.is_alive():
                    watch.poll()
                    worker.join(0.1)
            finally:
                worker.join()
                watch.close()
            call_ms = int((time.monotonic() - t0) * 1000)
            if "ok" in outcome:
                # JOB_COMPLETED (the statistics, downtime included) is dispatched by the event loop thread,
                # possibly after the call returned: keep the callback until it came (deregistered, a
                # queued event is dropped and the copy would report 0 ms downtime and 0 bytes)
                arrived.wait(JOB_COMPLETED_WAIT_S)
        finally:
            try:
                self.conn.domainEventDeregisterAny(callback)
            except libvirt.libvirtError:
                pass
        if "error" in outcome:
            raise DriverError(
                self.host, f"migration of {name} to {target.host} failed{watch.why()}: {outcome['error']}"
            )
        return MigrationStats(
            total_ms=int(completed.get("time_elapsed") or call_ms),
            downtime_ms=int(completed.get("downtime") or 0),
            bytes_sent=int(completed.get("data_processed") or completed.get("memory_processed") or 0),
            extra={
                "call_ms": call_ms,
                "postcopy_switch_s": round(watch.switched, 2) if watch.switched else None,
                "first_pass_s": round(watch.first_pass_at - t0, 2) if watch.first_pass_at else None,
                "iterations": completed.get("memory_iteration"),
                "deadline": watch.deadline_action,
                "disk_bytes": int(completed.get("disk_processed") or watch.disk_bytes),
                "disk_total": int(completed.get("disk_total") or 0),
                "memory_bytes": int(completed.get("memory_processed") or 0),
            },
        )

    def _abort_job(self, dom: libvirt.virDomain) -> bool:
        """abortJob(); False when there is nothing to abort (no job, or no domain); other errors raise
        (a post-copy can not be aborted: libvirt refuses, and that is said)."""
        try:
            dom.abortJob()
            return True
        except libvirt.libvirtError as exc:
            if is_absent(exc) or (
                exc.get_error_code() == libvirt.VIR_ERR_OPERATION_INVALID
                and "no job" in (exc.get_error_message() or "")
            ):
                return False
            raise DriverError(self.host, f"abort the migration of {dom.name()}: {exc.get_error_message()}") from None

    def abort_migration(self, name: str) -> None:
        """Abort the outgoing migration of `name`. Asked before libvirt's job exists (a copy this driver
        is about to start), the cancel is kept and honoured once the job shows. Nothing to abort (no such
        domain, no job) is no error; any other error raises DriverError."""
        with self._abort_lock:
            if name in self._outgoing:
                self._pending_aborts.add(name)
        dom = self._lookup(name)
        if dom is None:
            return
        if self._abort_job(dom):
            with self._abort_lock:
                self._pending_aborts.discard(name)

    def resume_postcopy(self, name: str, target: Driver, params: MigrationParams) -> None:
        """Recover a failed post-copy migration (both QEMUs paused, reason postcopy-failed): the same
        migration again with VIR_MIGRATE_POSTCOPY_RESUME; returns once libvirt says it completed."""
        if not isinstance(target, LibvirtDriver):
            raise DriverError(self.host, "a libvirt host can only migrate to another libvirt host")
        dom = self._dom(name)
        flags, mparams = self._migration_args(target, replace(params, postcopy=True))
        self._call(
            "resume the failed post-copy migration",
            dom.migrateToURI3,
            target.p2p_uri(),
            mparams,
            flags | libvirt.VIR_MIGRATE_POSTCOPY_RESUME,
        )

    def migration_active(self, name: str) -> bool:
        """Whether libvirtd still runs a migration job of `name` here. A p2p migration belongs to the
        source daemon: it goes on (or fails) on its own when the control plane that asked for it dies.
        False only when the host says so (no domain, a shut-off one, or no job); a host that can not be asked
        raises. A shut-off domain has no job (libvirt refuses to say: "domain is not running"): a source left shut
        off by a migration whose destination failed its finish was asked again forever as a host that did not
        answer (CI, stop 45), and its VM, run by neither host, never settled as gone."""
        dom = self._lookup(name)
        if dom is None or not self._is_active(dom):
            return False
        try:
            kind = dom.jobInfo()[0]
        except libvirt.libvirtError as exc:
            if is_absent(exc):
                return False
            raise DriverError(self.host, f"job of {name}: {exc.get_error_message()}") from None
        return kind in (libvirt.VIR_DOMAIN_JOB_BOUNDED, libvirt.VIR_DOMAIN_JOB_UNBOUNDED)

    # -- guest networks: host commands (libvirt has no call for VXLAN devices or nftables) -----------------
    def apply_networks(self, want: HostNetworks) -> Applied:
        run, state_dir, prepare = hostnet.host_runner(self.host, self.uri)
        try:
            prepare(want)
        except subprocess.CalledProcessError as exc:
            raise DriverError(self.host, f"the provider networks' ports: {exc.cmd}: {exc.stderr}") from None
        except OSError as exc:
            raise DriverError(self.host, f"the provider networks' ports: {exc}") from None
        return hostnet.apply_all(self.host, run, state_dir, want)

    def p2p_uri(self) -> str:
        """The URI the source daemon uses to reach this one: `+unix` is required between daemons on one
        machine (a plain socket URI is taken for "the same host"). A remote URI is passed as added, so a
        host added as qemu+tls:// (or qemu+ssh://) is migrated to over TLS (ssh): the source daemon is the
        client then, with its own certificates (root: /etc/pki/libvirt/clientcert.pem, or the URI's
        pkipath, read on the source host) or ssh keys."""
        return self.uri if "+" in self.uri.split(":", 1)[0] else self.uri.replace("qemu://", "qemu+unix://", 1)

    def incoming_address(self) -> str:
        if self.migration_address:
            return self.migration_address
        host = re.match(r"^[a-z0-9+]+://(?:[^@/?]*@)?([^/:?]*)", self.uri)  # without qemu+ssh's user@
        return host.group(1) if host and host.group(1) else "127.0.0.1"

    # -- the guest's view ----------------------------------------------------------------------
    def guest_exec(self, name: str, command: str, timeout_s: float = 30.0) -> str:
        output, _code = self.guest_run(name, command, timeout_s)
        return output

    # The command runs under a small runner (one line of POSIX sh, busybox's applets only), never on the
    # console's shell itself: its text travels in base64 (any byte, newlines included, arrives as sent),
    # its standard input is /dev/null (a `dd` or a `cat` with no argument never reads the console), it
    # runs in a session of its own (setsid) and a watchdog kills that whole session at the time limit,
    # printing a timeout marker: the console's shell is free again for the next command and for a person.
    _EXEC_RUNNER = (
        'c=$(echo "$2" | base64 -d) || exit 125; t=/tmp/.vmp-$3.t; '
        'setsid sh -c "$c" </dev/null 2>&1 & p=$!; '
        'setsid sh -c "sleep $1 && : >$t && kill -9 -$p" </dev/null >/dev/null 2>&1 & w=$!; '
        "wait $p 2>/dev/null; r=$?; kill -9 -$w 2>/dev/null; "
        'if [ -e $t ]; then rm -f $t; echo; echo __VMP""_T$3__; exit 124; fi; exit $r'
    )
    EXEC_CHUNK = 2000  # base64 characters per console line (a tty line holds at most 4095)
    EXEC_GRACE_S = 5.0  # how long past the guest's own time limit the answer is waited for
    INTERRUPT_AFTER_S = 3.0  # a shell that does not answer the probe this long is sent Ctrl-C

    def guest_run(self, name: str, command: str, timeout_s: float = 30.0) -> tuple[str, int]:
        """Run a shell command line in the guest; (output, exit code). Through the guest agent when it takes
        the command (`agent_exec`), else through the serial console (`console_run`): a guest still booting
        (its agent not up yet), a guest without an agent. A command still running at `timeout_s` is
        stopped in the guest (DriverError says so)."""
        deadline = time.monotonic() + timeout_s
        try:
            return self.agent_exec(name, command, timeout_s)
        except AgentUnavailable as exc:
            log.debug("%s: %s; through the serial console instead", self.host, exc)
        return self.console_run(name, command, max(1.0, deadline - time.monotonic()))

    CONSOLE_BUSY_S = 5.0  # how long a console held by someone else is tried again before giving up

    def console_run(self, name: str, command: str, timeout_s: float = 30.0) -> tuple[str, int]:
        """Run a shell command line in the guest through its serial console; (output, exit code).

        The console is opened without libvirt's FORCE flag: a person who holds it (`virsh console`) is
        never kicked off; the command waits a little for it (CONSOLE_BUSY_S: another vmplane process's
        exchange ends soon), then fails saying who holds what. The guest may still be booting: a probe
        is sent again every half second until the shell answers, each time with its own markers, so late
        answers can not be mistaken for this one."""
        lock = self._console_locks.setdefault(name, threading.Lock())
        deadline = time.monotonic() + timeout_s
        with lock:
            self._dom(name)  # on the main connection: a missing domain or host is said as usual
            conn = self._console_conn()
            try:
                dom = self._call(f"looking up domain {name}", conn.lookupByName, name)
                while True:
                    stream = self._call("open a console stream", conn.newStream, libvirt.VIR_STREAM_NONBLOCK)
                    try:
                        if self._open_console(dom, stream, name, min(deadline, time.monotonic() + self.CONSOLE_BUSY_S)):
                            return self._console_exchange(stream, command, max(1.0, deadline - time.monotonic()))
                    finally:
                        try:
                            stream.abort()
                        except libvirt.libvirtError:
                            pass
                    time.sleep(0.2)
            finally:
                self._let_go(conn)

    def _open_console(self, dom, stream, name: str, give_up_at: float) -> bool:
        """Open the serial console on `stream` (no FORCE); False while someone else holds it, until
        `give_up_at`, then DriverError."""
        try:
            dom.openConsole(None, stream, 0)
            return True
        except libvirt.libvirtError as exc:
            if "active console session" not in (exc.get_error_message() or "").lower():
                raise DriverError(self.host, f"open console: {exc.get_error_message()}") from None
            if time.monotonic() < give_up_at:
                return False
            raise DriverError(
                self.host,
                f"the serial console of {name} is held by someone else (a `virsh console`?) and its guest "
                "agent does not answer: vmplane does not take the console from a person; try again when "
                "they let go",
            ) from None

    def _console_conn(self) -> libvirt.virConnect:
        """A connection of its own for one console exchange. When the guest goes while its console stream is
        open (a `poweroff` run through it), libvirt's client closes the connection that carries the stream:
        on the main connection that lost the lifecycle events in flight (the domain's STOPPED among them)
        and failed the event's own read-back, so the VM waited for the next full sync to be recorded
        stopped (CI, issue 28: `test_a_guest_that_powers_itself_off...`, cause `sync`)."""
        try:
            return libvirt.open(self.uri)
        except libvirt.libvirtError as exc:
            raise DriverError(self.host, f"cannot connect to {self.uri}: {exc.get_error_message()}") from None

    def _let_go(self, conn: libvirt.virConnect) -> None:
        """Close a console connection; one that died is kept instead (see `conn`: never freed)."""
        try:
            if conn.isAlive():
                conn.close()
                return
        except libvirt.libvirtError:
            pass
        with self._conn_lock:
            self._dead.append(conn)

    def _console_exchange(self, stream, command: str, timeout_s: float) -> tuple[str, int]:
        """First make sure the shell answers (a harmless echo, repeated while the guest boots; Ctrl-C
        now and then frees a shell left busy by someone else), then send the command once; markers
        carry a fresh tag so no earlier output can be taken for its."""
        deadline = time.monotonic() + timeout_s
        self._await_shell(stream, deadline, command)
        tag = uuid.uuid4().hex[:12]
        for line in exec_lines(
            command, tag, max(1, int(deadline - time.monotonic())), self._EXEC_RUNNER, self.EXEC_CHUNK
        ):
            self._send(stream, line)
        answer_by = max(deadline, time.monotonic() + 1) + self.EXEC_GRACE_S
        buf = b""
        while True:
            try:
                buf = self._receive(stream, buf, answer_by, command)
            except DriverError:
                self._send_quietly(stream, "\x03")  # the runner itself is stuck: interrupt it
                raise
            for m in _MARK.finditer(buf):
                if m.group(1).decode() == tag:
                    return exec_result(m.group(2), int(m.group(3)), tag, command, self.host)

    def _await_shell(self, stream, deadline: float, command: str) -> None:
        buf = b""
        probes: set[str] = set()
        next_probe = 0.0
        next_interrupt = time.monotonic() + self.INTERRUPT_AFTER_S
        while not any(f"__VMP_R{t}__".encode() in buf for t in probes):
            now = time.monotonic()
            if now >= next_interrupt:
                self._send(stream, "\x03")
                next_interrupt = now + self.INTERRUPT_AFTER_S
            if now >= next_probe:
                tag = uuid.uuid4().hex[:12]
                probes.add(tag)
                # the quotes keep an echoed command line from matching the markers
                self._send(stream, f"echo __VMP''_R{tag}__\n")
                next_probe = now + 0.5
            buf = self._receive(stream, buf, deadline, command)

    def _send_quietly(self, stream, text: str) -> None:
        try:
            stream.send(text.encode())
        except libvirt.libvirtError:
            pass

    def _send(self, stream, text: str) -> None:
        try:
            stream.send(text.encode())
        except libvirt.libvirtError as exc:
            raise DriverError(self.host, f"console: {exc.get_error_message()}") from None

    def _receive(self, stream, buf: bytes, deadline: float, command: str) -> bytes:
        try:
            data = stream.recv(65536)
        except libvirt.libvirtError as exc:
            raise DriverError(self.host, f"console: {exc.get_error_message()}") from None
        if data == b"":
            raise DriverError(self.host, "the console closed: the domain stopped or went away")
        if time.monotonic() > deadline:
            raise DriverError(
                self.host,
                f"the guest did not answer {command!r} in time; console tail: {buf[-300:].decode(errors='replace')!r}",
            )
        if isinstance(data, bytes):
            return buf + data
        time.sleep(0.02)
        return buf

    def guest_view(self, name: str) -> GuestView:
        out = self.guest_exec(name, "cat /sys/devices/system/cpu/online; grep MemTotal /proc/meminfo")
        online, mem = out.strip().splitlines()[-2:]
        return GuestView(count_cpu_list(online), int(mem.split()[1]))

    # -- local measurement ---------------------------------------------------------------------
    def qemu_pid(self, name: str) -> int:
        """The QEMU process of a domain on a local host (for measurements: CPU time from /proc)."""
        sock = re.search(r"socket=([^&]+)", self.uri)
        if not sock:
            raise DriverError(self.host, "the QEMU pid is only known for local hosts")
        pid_file = Path(sock.group(1)).parent / "qemu" / f"{name}.pid"
        try:
            return int(pid_file.read_text().strip())
        except OSError as exc:
            raise DriverError(self.host, f"no QEMU pid for {name}: {exc}") from None


class _CopyWatch:
    """One poll of a running copy (LibvirtDriver.migrate): progress, a cancel kept until the job
    exists, the early switch to post-copy, the deadline. The progress is written by a thread of its own
    (the newest report only): a store write that waits must never hold back the next poll, whose switch
    to post-copy is due at a set time into the first pass (late, the copy ends as pre-copy)."""

    def __init__(
        self,
        driver: LibvirtDriver,
        dom,
        name: str,
        params: MigrationParams,
        progress: ProgressCallback | None,
        t0: float,
    ):
        self.driver, self.dom, self.name, self.params, self.progress, self.t0 = driver, dom, name, params, progress, t0
        self.switched: float | None = None  # s after t0 of the switch to post-copy; -1: finished first
        self.first_pass_at: float | None = None  # when memory started to move (iteration reads 0 in pass 1)
        self.deadline_action: str | None = None  # what the deadline did: "postcopy", "aborted", "in post-copy"
        self.cancelled = False
        self.percent = 0  # reported so far (never goes back)
        self.disk_bytes = 0  # disk bytes copied so far (jobStats disk_processed)
        self.memory_estimate = 0  # the domain's memory, until the memory copy reports its total
        self._report_lock = threading.Condition()
        self._newest: tuple[int, str] | None = None  # the report not yet written
        self._closed = False
        self._writer: threading.Thread | None = None
        if params.copy_disks:
            try:
                self.memory_estimate = dom.info()[2] * 1024
            except libvirt.libvirtError:
                pass

    def why(self) -> str:
        if self.cancelled:
            return " (cancelled)"
        if self.deadline_action == "aborted":
            return f" (timed out after {self.params.timeout_s:g} s, vmplane.migration.timeout: aborted)"
        return ""

    def poll(self) -> None:
        try:
            stats = self.dom.jobStats(0)
        except libvirt.libvirtError:
            stats = {}
        job = stats.get("type") in (libvirt.VIR_DOMAIN_JOB_BOUNDED, libvirt.VIR_DOMAIN_JOB_UNBOUNDED)
        if job and self.driver._take_pending_abort(self.name):
            self.cancelled = True
            if not self._abort():
                with self.driver._abort_lock:  # kept: tried again at the next poll
                    self.driver._pending_aborts.add(self.name)
        self._report(stats)
        now = time.monotonic()
        if self.first_pass_at is None and (stats.get("memory_processed") or 0) > 0:
            self.first_pass_at = now
        p = self.params
        # switch during the first pass (healthy 13/13 under TCG), not after it (2/8)
        if (
            p.postcopy
            and self.switched is None
            and p.postcopy_after_s is not None
            and self.first_pass_at is not None
            and now - self.first_pass_at >= p.postcopy_after_s
        ):
            self._switch()
        if p.timeout_s and self.deadline_action is None and job and now - self.t0 >= p.timeout_s:
            self._deadline()

    def _report(self, stats: dict) -> None:
        report = self.describe(stats)
        if report is None:
            return
        with self._report_lock:
            self._newest = report
            self._report_lock.notify()
            if self._writer is None:  # in the copy's context: its owner fences the writes, its cause names them
                self._writer = threading.Thread(
                    target=contextvars.copy_context().run,
                    args=(self._write_reports,),
                    name=f"migrate-{self.name}-progress",
                    daemon=True,
                )
                self._writer.start()

    def describe(self, stats: dict) -> tuple[int, str] | None:
        """The progress one jobStats answer shows (percent, words), or None when there is none to show.
        Memory and disk bytes together: libvirt mirrors the disks first (disk_* in jobStats), then
        copies memory while the mirror keeps the copies in step; until memory_total shows, the domain's
        memory stands in for it so that the percentage never goes back."""
        mem_total, mem_left = stats.get("memory_total") or 0, stats.get("memory_remaining") or 0
        disk_total, disk_left = stats.get("disk_total") or 0, stats.get("disk_remaining") or 0
        self.disk_bytes = max(self.disk_bytes, stats.get("disk_processed") or 0)
        if not mem_total and disk_total:
            mem_total = mem_left = self.memory_estimate
        total = mem_total + disk_total
        if not (self.progress and total):
            return None
        remaining = mem_left + disk_left
        self.percent = max(self.percent, min(99, int(100 * (total - remaining) / total)))
        words = (
            (f"disks {(disk_total - disk_left) >> 20}/{disk_total >> 20} MiB, " if disk_total else "")
            + f"copied {(total - remaining) >> 20} of {total >> 20} MiB, iteration "
            f"{stats.get('memory_iteration', 0)}, {remaining >> 20} MiB left"
            + (", post-copy" if self.switched and self.switched > 0 else "")
        )
        return self.percent, words

    def _write_reports(self) -> None:
        while True:
            with self._report_lock:
                while self._newest is None and not self._closed:
                    self._report_lock.wait()
                report, self._newest = self._newest, None
                if report is None:
                    return  # closed, nothing left to write
            try:
                if self.progress is not None:  # (None: nobody asked; the call would raise, swallowed below)
                    self.progress(*report)
            except Exception:  # noqa: BLE001 - only a report: the copy goes on, its outcome is asked of the hosts
                pass

    def close(self) -> None:
        """After the copy: the last report written (or dropped), the writer gone (before the outcome is recorded)."""
        with self._report_lock:
            self._closed = True
            self._newest = None  # the outcome follows; a report now would only be overwritten
            self._report_lock.notify()
        if self._writer is not None:
            self._writer.join()

    def _switch(self) -> None:
        try:
            self.dom.migrateStartPostCopy(0)
            self.switched = time.monotonic() - self.t0
        except libvirt.libvirtError:
            self.switched = -1.0  # finished as pre-copy before the switch

    def _deadline(self) -> None:
        p = self.params
        if self.switched is not None and self.switched > 0:
            self.deadline_action = "in post-copy"  # can not be aborted; it completes by itself
        elif p.timeout_action == "postcopy" and p.postcopy and self.switched is None:
            self._switch()
            self.deadline_action = "postcopy" if self.switched and self.switched > 0 else None
        elif self._abort():
            self.deadline_action = "aborted"  # else tried again at the next poll

    def _abort(self) -> bool:
        try:
            self.driver._abort_job(self.dom)
            return True
        except DriverError:
            return False  # e.g. the host does not answer; the caller asks the hosts after the copy


def dimms_to_release(sizes_mib: list[int], release_mib: int) -> list[int] | None:
    """Which DIMMs (indices into `sizes_mib`, oldest first) add up to exactly `release_mib`: the fewest
    DIMMs that do, the newest among equals, newest first (the order to unplug them); None if no subset
    does. A subset sum over the sums up to the release (DIMMs are few and sized in MiB)."""
    if release_mib <= 0:
        return [] if release_mib == 0 else None
    best: dict[int, tuple[int, ...]] = {0: ()}  # reachable sum -> the fewest DIMMs reaching it
    for i in reversed(range(len(sizes_mib))):  # newest first: among equals, the first found stays
        size = sizes_mib[i]
        if size <= 0:
            continue
        for total, picked in list(best.items()):
            after = total + size
            if after <= release_mib and (after not in best or len(best[after]) > len(picked) + 1):
                best[after] = picked + (i,)
    return list(best[release_mib]) if release_mib in best else None


def count_cpu_list(text: str) -> int:
    """'0-2,4' -> 4 (the kernel's cpu list format)."""
    total = 0
    for part in text.strip().split(","):
        if "-" in part:
            lo, hi = part.split("-")
            total += int(hi) - int(lo) + 1
        elif part:
            total += 1
    return total


def _probe_cache(driver: LibvirtDriver) -> Path:
    caps = ElementTree.fromstring(driver.conn.getCapabilities())
    model = caps.findtext("host/cpu/model") or "?"
    key = hashlib.sha256(f"{driver.conn.getHostname()}|{model}|{os.uname().release}".encode()).hexdigest()[:16]
    return guest.cache_dir().parent / f"accel-{key}.json"


PROBE_PREFIX = "vmplane-probe-"  # the audit names such a domain a leftover probe, not a VM


def _discard_leftover_probes(driver: LibvirtDriver) -> None:
    """Probe domains an earlier, interrupted probe left on this host (they hold memory without a claim)."""
    try:
        leftovers = [d for d in driver.conn.listAllDomains() if d.name().startswith(PROBE_PREFIX)]
    except libvirt.libvirtError:
        return
    for dom in leftovers:
        try:
            discard_domain(dom)
        except libvirt.libvirtError:
            pass  # still there: the audit reports it as a leftover probe


def probe_accel(driver: LibvirtDriver, timeout_s: float = 20.0) -> str:
    """KVM only if a probe guest boots under it on this host, else TCG ("qemu"); remembered per machine."""
    cache = _probe_cache(driver)
    try:
        return json.loads(cache.read_text())["accel"]
    except (OSError, ValueError, KeyError):
        pass
    accel, why = "qemu", "no KVM on this host"
    try:
        driver.conn.getDomainCapabilities(None, None, None, "kvm", 0)
        kvm_listed = True
    except libvirt.libvirtError:
        kvm_listed = False
    if kvm_listed:
        _discard_leftover_probes(driver)
        name = f"{PROBE_PREFIX}{uuid.uuid4().hex[:8]}"
        spec = DomainSpec(name, 1, 1, 256, 256, guest.IMAGE_NAME)
        dom = None
        try:
            dom = driver.conn.defineXML(driver.domain_xml(spec, accel="kvm"))
            dom.create()
            driver.guest_run(name, "true", timeout_s)
            accel, why = "kvm", "a probe guest booted under KVM"
        except (libvirt.libvirtError, DriverError) as exc:
            why = f"a probe guest did not boot under KVM within {timeout_s:.0f} s ({str(exc)[:120]})"
        finally:
            if dom is not None:
                discard_domain(dom)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"accel": accel, "why": why}))
    return accel
