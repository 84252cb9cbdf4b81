"""Real BMC emulators for the fence-agent tests, each wired to a local host's power.

ipmi_sim (OpenIPMI) and sushy-emulator (sushy-tools) run as their own processes on free loopback
ports, with users and passwords. Their power control is the local host itself: powering off runs
`localhosts.fail(host, "power")` (the power cut), and the power state they report is whether any of
the host's processes (libvirtd, QEMU, virtlockd, heartbeat) is alive. ipmi_sim calls its
`chassis_control` program (`PROG get power` -> "power:1", `PROG set power 0`); sushy-emulator gets a
systems driver (its fake driver with the power calls replaced) through this module run as a program:
  python -m tests.bmckit chassis URI get|set power [VALUE]
  python -m tests.bmckit redfish URI PORT AUTH_FILE STATE_DIR
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from vmplane.hosts import localhosts

ROOT = Path(__file__).resolve().parents[1]


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _powered(host: localhosts.LocalHost) -> bool:
    return any(localhosts.processes(host).values())


def _set_power(host: localhosts.LocalHost, on: bool) -> None:
    if on:
        localhosts.recover(host)
    else:
        localhosts.fail(host, "power")


class _Emulator:
    proc: subprocess.Popen | None = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class IpmiSim(_Emulator):
    """ipmi_sim with one BMC (0x20) on a LAN channel at 127.0.0.1:PORT (UDP), user `user`/`password`."""

    def __init__(self, folder: Path, host: localhosts.LocalHost, user: str, password: str):
        self.port = free_port(socket.SOCK_DGRAM)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "state").mkdir(exist_ok=True)
        control = folder / "chassis.sh"
        control.write_text(
            f"#!/bin/sh\ncd {ROOT} && exec {sys.executable} -m tests.bmckit chassis '{host.uri}' \"$@\"\n"
        )
        control.chmod(0o755)
        auths = "none md2 md5 straight"
        (folder / "lan.conf").write_text(f"""name "vmplane{self.port}"
set_working_mc 0x20
  startlan 1
    addr 127.0.0.1 {self.port}
    priv_limit admin
    allowed_auths_callback {auths}
    allowed_auths_user {auths}
    allowed_auths_operator {auths}
    allowed_auths_admin {auths}
    guid a123456789abcdefa123456789abcdef
  endlan
  chassis_control "{control}"
user 2 true "{user}" "{password}" admin 10 {auths}
""")
        (folder / "cmds").write_text(
            "mc_setbmc 0x20\nmc_add 0x20 0 no-device-sdrs 0x23 9 8 0x9f 0x1291 0xf02\nmc_enable 0x20\n"
        )
        self.folder = folder

    def start(self) -> IpmiSim:
        f = self.folder
        with open(f / "sim.out", "wb") as out:
            self.proc = subprocess.Popen(
                ["ipmi_sim", "-c", f / "lan.conf", "-f", f / "cmds", "-s", f / "state", "-n"],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        time.sleep(0.5)
        if self.proc.poll() is not None:
            raise RuntimeError(f"ipmi_sim did not start: {(f / 'sim.out').read_text()}")
        return self


class SushyEmulator(_Emulator):
    """sushy-emulator at http://127.0.0.1:PORT with one system (the host), HTTP basic auth."""

    def __init__(self, folder: Path, host: localhosts.LocalHost, user: str, password: str):
        import bcrypt

        self.port = free_port()
        self.folder, self.host = folder, host
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "state").mkdir(exist_ok=True)
        (folder / "htpasswd").write_text(f"{user}:{bcrypt.hashpw(password.encode(), bcrypt.gensalt()).decode()}\n")
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> SushyEmulator:
        import httpx

        f = self.folder
        with open(f / "emulator.out", "wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.bmckit",
                    "redfish",
                    self.host.uri,
                    str(self.port),
                    str(f / "htpasswd"),
                    str(f / "state"),
                ],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                httpx.get(self.url + "/redfish/v1", timeout=1)
                return self
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"sushy-emulator did not come up: {(f / 'emulator.out').read_text()[-2000:]}")


def _chassis(uri: str, args: list[str]) -> int:
    host = localhosts.from_uri(uri)
    if "get" in args:
        print(f"power:{int(_powered(host))}")
    elif args[args.index("set") + 1 : args.index("set") + 2] == ["power"]:
        _set_power(host, args[args.index("set") + 2].strip('"') != "0")
    return 0


def _redfish(uri: str, port: int, auth_file: str, state_dir: str) -> None:
    from sushy_tools.emulator import main
    from sushy_tools.emulator.resources.systems.fakedriver import FakeDriver

    host = localhosts.from_uri(uri)

    class HostSystems(FakeDriver):
        """The fake driver's system description, with the real host's power."""

        def get_power_state(self, identity):
            self._get(identity)
            return "On" if _powered(host) else "Off"

        def set_power_state(self, identity, state):
            self._get(identity)
            if state in ("ForceOff", "GracefulShutdown", "PushPowerButton"):
                _set_power(host, False)
            elif state in ("On", "ForceOn"):
                _set_power(host, True)

    main.app.configure(
        extra_config={
            "SUSHY_EMULATOR_AUTH_FILE": auth_file,
            "SUSHY_EMULATOR_STATE_DIR": state_dir,
            "SUSHY_EMULATOR_FAKE_SYSTEMS": [
                {"uuid": "6f7d2a5e-0c1b-4b7e-9a53-5c2f6d1e8a01", "name": host.name, "power_state": "On", "nics": []}
            ],
        }
    )
    systems = HostSystems.initialize(main.app.config, main.app.logger)()
    main.Application.systems = property(lambda self: systems)
    main.app.run(host="127.0.0.1", port=port)


if __name__ == "__main__":
    if sys.argv[1] == "chassis":
        sys.exit(_chassis(sys.argv[2], sys.argv[3:]))
    _redfish(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
