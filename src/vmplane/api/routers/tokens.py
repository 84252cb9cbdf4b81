"""API tokens: create (admin), list and revoke (an admin any token, a member its project's)."""

from fastapi import APIRouter

from vmplane.api.deps import Admin, AnyCaller, Orch
from vmplane.api.paging import StrictQueryRoute
from vmplane.api.schemas import TokenCreate, TokenInfo, TokenOut

router = APIRouter(tags=["tokens"], route_class=StrictQueryRoute)


@router.post("/tokens", status_code=201, response_model=TokenOut)
def create_token(body: TokenCreate, orch: Orch, _: Admin):
    token = orch.catalog.create_token(body.name, body.role, body.project)
    return TokenOut(name=body.name, role=body.role, project=body.project, token=token)


@router.get("/tokens", response_model=list[TokenInfo])
def list_tokens(orch: Orch, who: AnyCaller):
    """Name, role, project and creation time (never the secret nor its hash): every token for an admin,
    its project's tokens for a member."""
    return orch.catalog.tokens(None if who.is_admin else who.project_id)


@router.delete("/tokens/{name}", status_code=204)
def revoke_token(name: str, orch: Orch, who: AnyCaller) -> None:
    """Revoke a token: refused at once (401) by every control-plane process. A member can revoke its
    project's tokens only (others are 404); the last admin token can not be revoked (409)."""
    orch.catalog.revoke_token(name, None if who.is_admin else who.project_id)
