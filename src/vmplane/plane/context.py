"""The Plane: what every controller of this process shares, handed to each in its constructor.

As Kubernetes' scheduler framework hands its plugins a `Handle`, and KubeVirt's controller app its
controllers their informers: the store, the admin catalog (settings through `catalog.effective`), the
host drivers, the capacity mirror, this process's membership among its peers, the operation runner,
the admission batcher, the executor, the shutdown event, and the VMs start-up recovery still holds.
Nothing here knows a controller; controllers meet their peers only through their constructors.
"""

from __future__ import annotations

import threading
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vmplane.core.driver import Driver
from vmplane.core.errors import Conflict
from vmplane.store import Database
from vmplane.store.admission import Batcher
from vmplane.store.catalog import Catalog

if TYPE_CHECKING:
    from vmplane.plane.capacity import Capacity
    from vmplane.plane.membership import Membership
    from vmplane.plane.operations import Operations


class PendingVms:
    """The VMs start-up recovery has not finished with (vm name -> (phase, why)): written by the
    recovery controller, read by settle (a listener leaves them alone) and the API (refused, 409)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[str, str]] = {}

    def replace(self, plan: dict[str, tuple[str, str]]) -> None:
        with self._lock:
            self._pending = dict(plan)

    def finish_phase(self, phase: str) -> None:
        with self._lock:
            self._pending = {k: v for k, v in self._pending.items() if v[0] != phase}

    def clear(self) -> None:
        with self._lock:
            self._pending.clear()

    def busy(self, vm: str) -> bool:
        with self._lock:
            return vm in self._pending

    def check(self, vm: str) -> None:
        """Refuse (409) an operation on a VM that start-up recovery has not finished with."""
        with self._lock:
            pending = self._pending.get(vm)
        if pending is not None:
            raise Conflict(
                f"vm {vm} is still being recovered after a restart ({pending[1]}); retry in a moment "
                f"(GET /api/v1/recovery shows progress)",
                field="vm",
            )

    def why(self) -> dict[str, str]:
        with self._lock:
            return {name: why for name, (_, why) in sorted(self._pending.items())}

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)


@dataclass(eq=False)
class Plane:
    """The shared runtime of one control-plane process (built by the orchestrator, the composition root)."""

    db: Database
    catalog: Catalog
    drivers: dict[str, Driver]  # host name -> driver; changed only by hostadmin, under capacity.lock
    capacity: Capacity
    membership: Membership
    admissions: Batcher  # group commit of admissions (shares capacity.lock)
    executor: Executor
    closing: threading.Event = field(default_factory=threading.Event)  # set by close(): waits end early
    recovering: PendingVms = field(default_factory=PendingVms)
    ops: Operations = field(init=False)  # the operation runner, set once the Plane exists (it takes the Plane)
