"""Operations: state and progress of asynchronous requests; the ledger audit."""

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Response

from vmplane.api.deps import Admin, AnyCaller, Orch
from vmplane.api.paging import Paging, StrictQueryRoute, paged
from vmplane.api.schemas import AuditOut, OperationOut
from vmplane.api.views import operation_out
from vmplane.store import events

router = APIRouter(tags=["operations"], route_class=StrictQueryRoute)


@router.get("/operations", response_model=list[OperationOut])
def list_operations(
    orch: Orch,
    who: AnyCaller,
    response: Response,
    page: Paging,
    state: Literal["pending", "running", "succeeded", "failed"] | None = None,
    kind: Annotated[str | None, Query(max_length=24, description="start, stop, scale, drain, reconcile, ...")] = None,
    vm: str | None = None,
    host: str | None = None,
):
    """Operations, newest first; `vm` / `host` name what they act on (`host`: drains). `sort`: created_at,
    updated_at, kind, state, progress. The total is in the X-Total-Count header."""
    ops, total = orch.operation_page(
        page, state=state, kind=kind, vm=vm, host=host, project_id=None if who.is_admin else who.project_id
    )
    by = events.first_causes(orch.db, "operation", [op.id for op in ops])
    return paged(response, [operation_out(op, by.get(op.id)) for op in ops], total)


@router.get("/operations/{op_id}", response_model=OperationOut)
def show_operation(op_id: str, orch: Orch, who: AnyCaller):
    """By id, or by a unique prefix of it (at least 4 characters; 409 naming the matches when several).
    A member sees its project's operations only (a drain belongs to no project)."""
    op = orch.find_operation(op_id, None if who.is_admin else who.project_id)
    return operation_out(op, events.first_causes(orch.db, "operation", [op.id]).get(op.id))


@router.get("/audit", response_model=AuditOut)
def audit(orch: Orch, _: Admin):
    problems = orch.audit()
    return AuditOut(ok=not problems, problems=problems)
