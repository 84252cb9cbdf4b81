"""Compute offerings and templates."""

from fastapi import APIRouter

from vmplane.api.deps import Admin, AnyCaller, Orch
from vmplane.api.paging import StrictQueryRoute
from vmplane.api.schemas import OfferingCreate, OfferingOut, TemplateCreate, TemplateOut
from vmplane.core.model import Offering, OfferingKind
from vmplane.store import lifecycle
from vmplane.store.schema import Offering as OfferingRow
from vmplane.store.schema import Template as TemplateRow

router = APIRouter(tags=["offerings and templates"], route_class=StrictQueryRoute)


@router.post("/offerings", status_code=201, response_model=OfferingOut)
def create_offering(body: OfferingCreate, orch: Orch, _: Admin):
    data = Offering(**{**body.model_dump(), "kind": OfferingKind(body.kind)})
    return OfferingOut.model_validate(orch.catalog.create_offering(data))


@router.get("/offerings", response_model=list[OfferingOut])
def list_offerings(orch: Orch, _: AnyCaller):
    return [OfferingOut.model_validate(o) for o in orch.catalog.offerings()]


@router.get("/offerings/{name}", response_model=OfferingOut)
def show_offering(name: str, orch: Orch, _: AnyCaller):
    return OfferingOut.model_validate(orch.catalog.offering(name))


@router.post("/offerings/{name}/retire", response_model=OfferingOut)
def retire_offering(name: str, orch: Orch, _: Admin):
    """No new VMs from it (409 naming it); VMs using it keep it. Retiring twice is a 409."""
    return OfferingOut.model_validate(orch.catalog.retire(OfferingRow, name))


@router.delete("/offerings/{name}", status_code=204)
def delete_offering(name: str, orch: Orch, _: Admin) -> None:
    """Refused (409) while VMs use it, naming them: retire it instead."""
    lifecycle.delete_offering(orch.catalog, name)


@router.post("/templates", status_code=201, response_model=TemplateOut)
def create_template(body: TemplateCreate, orch: Orch, _: Admin):
    return TemplateOut.model_validate(
        orch.catalog.create_template(
            body.name, body.image, body.dynamic_scaling, disk=body.disk, from_image=body.from_image
        )
    )


@router.get("/templates", response_model=list[TemplateOut])
def list_templates(orch: Orch, _: AnyCaller):
    return [TemplateOut.model_validate(t) for t in orch.catalog.templates()]


@router.get("/templates/{name}", response_model=TemplateOut)
def show_template(name: str, orch: Orch, _: AnyCaller):
    return TemplateOut.model_validate(orch.catalog.template(name))


@router.post("/templates/{name}/retire", response_model=TemplateOut)
def retire_template(name: str, orch: Orch, _: Admin):
    """No new VMs from it (409 naming it); VMs using it keep it. Retiring twice is a 409."""
    return TemplateOut.model_validate(orch.catalog.retire(TemplateRow, name))


@router.delete("/templates/{name}", status_code=204)
def delete_template(name: str, orch: Orch, _: Admin) -> None:
    """Refused (409) while VMs use it, naming them: retire it instead."""
    lifecycle.delete_template(orch.catalog, name)
