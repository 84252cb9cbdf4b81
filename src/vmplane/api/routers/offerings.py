"""Compute offerings and templates."""

from fastapi import APIRouter

from ...model import Offering, OfferingKind
from ..deps import Admin, AnyCaller, Orch
from ..schemas import OfferingCreate, OfferingOut, TemplateCreate, TemplateOut

router = APIRouter(tags=["offerings and templates"])


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


@router.post("/templates", status_code=201, response_model=TemplateOut)
def create_template(body: TemplateCreate, orch: Orch, _: Admin):
    return TemplateOut.model_validate(orch.catalog.create_template(body.name, body.image,
                                                                   body.dynamically_scalable))


@router.get("/templates", response_model=list[TemplateOut])
def list_templates(orch: Orch, _: AnyCaller):
    return [TemplateOut.model_validate(t) for t in orch.catalog.templates()]


@router.get("/templates/{name}", response_model=TemplateOut)
def show_template(name: str, orch: Orch, _: AnyCaller):
    return TemplateOut.model_validate(orch.catalog.template(name))
