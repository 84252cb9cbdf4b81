"""The control-plane processes of this store: their leases and what each holds and runs (admins)."""

from fastapi import APIRouter

from vmplane.api.deps import Admin, Orch
from vmplane.api.paging import StrictQueryRoute

router = APIRouter(tags=["health"], route_class=StrictQueryRoute)


@router.get("/controllers")
def list_controllers(orch: Orch, _: Admin) -> list[dict]:
    """Every control-plane process live now or stopped within the hour: its epoch (fencing token), name,
    state (live, expired, lapsed, stopped), seconds left on its lease, whether it is the coordinator, the
    hosts it listens to, and the operations and migrations it owns. `this` marks the process that answers."""
    return orch.controllers.rows()
