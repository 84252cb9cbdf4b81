"""Settings at global, zone and cluster scope."""

from typing import Literal

from fastapi import APIRouter

from ..deps import Admin, Orch
from ..schemas import SettingOut, SettingSet

router = APIRouter(tags=["settings"])


@router.get("/settings")
def list_settings(orch: Orch, _: Admin) -> list[dict]:
    return orch.catalog.list_settings()


@router.get("/settings/{key}", response_model=SettingOut)
def get_setting(key: str, orch: Orch, _: Admin, scope: Literal["global", "zone", "cluster"] = "global",
                scope_name: str | None = None):
    return orch.catalog.get_setting(key, scope, scope_name)


@router.put("/settings/{key}", response_model=SettingOut)
def set_setting(key: str, body: SettingSet, orch: Orch, _: Admin):
    value = str(body.value).lower() if isinstance(body.value, bool) else str(body.value)
    return orch.catalog.set_setting(key, value, body.scope, body.scope_name)
