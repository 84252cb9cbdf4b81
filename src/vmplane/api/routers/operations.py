"""Operations: state and progress of asynchronous requests; the ledger audit; tokens."""

from typing import Annotated, Literal

from fastapi import APIRouter, Query

from ..deps import Admin, AnyCaller, Orch
from ..schemas import AuditOut, OperationOut, TokenCreate, TokenOut
from ..views import operation_out

router = APIRouter(tags=["operations"])


@router.get("/operations", response_model=list[OperationOut])
def list_operations(orch: Orch, who: AnyCaller,
                    state: Literal["pending", "running", "succeeded", "failed"] | None = None,
                    limit: Annotated[int, Query(ge=1, le=1000)] = 100):
    ops = orch.operations(state, limit)
    return [operation_out(op) for op in ops if who.is_admin or op.project_id == who.project_id]


@router.get("/operations/{op_id}", response_model=OperationOut)
def show_operation(op_id: str, orch: Orch, who: AnyCaller):
    op = orch.operation(op_id)
    if op.project_id is not None:
        who.check_project(op.project_id, "operation", op_id)
    elif not who.is_admin:
        who.check_project(-1, "operation", op_id)
    return operation_out(op)


@router.get("/audit", response_model=AuditOut)
def audit(orch: Orch, _: Admin):
    problems = orch.audit()
    return AuditOut(ok=not problems, problems=problems)


@router.post("/tokens", status_code=201, response_model=TokenOut)
def create_token(body: TokenCreate, orch: Orch, _: Admin):
    token = orch.catalog.create_token(body.name, body.role, body.project)
    return TokenOut(name=body.name, role=body.role, project=body.project, token=token)
