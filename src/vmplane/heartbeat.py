"""A host's heartbeat onto shared storage: `python -m vmplane.heartbeat --file PATH --interval 1`.

What a host runs so that the control plane can tell "the host is dead" from "I can not reach it"
(docs/design/ha.md): a file on storage every host and the control plane see, rewritten
every interval with a counter and the time, as VMware's datastore heartbeat and CloudStack's NFS
heartbeat do. The control plane reads its age (liveness.heartbeat_signal). Each write goes to a
temporary file renamed over the old one, so a reader never sees half a heartbeat. A failed write
(storage away for a while) is reported and retried at the next beat: the writer itself never stops
on its own, only its host's death stops it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path


def beat(path: Path, counter: int) -> None:
    """Write one heartbeat atomically (tmp + fsync + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump({"counter": counter, "time": time.time(), "pid": os.getpid()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vmplane.heartbeat", description=__doc__.splitlines()[0])
    parser.add_argument("--file", required=True, type=Path, help="the heartbeat file on shared storage")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between two writes")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    counter = 0
    while True:
        counter += 1
        try:
            beat(args.file, counter)
        except OSError as exc:
            print(f"heartbeat {args.file}: {exc}", file=sys.stderr, flush=True)
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
