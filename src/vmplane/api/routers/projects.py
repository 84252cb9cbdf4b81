"""Projects: quotas and usage."""

from fastapi import APIRouter

from vmplane.api.deps import Admin, AnyCaller, Orch
from vmplane.api.paging import StrictQueryRoute
from vmplane.api.schemas import ProjectCreate, ProjectOut, QuotaUpdate, UsageOut
from vmplane.api.views import project_out
from vmplane.core.quota import describe_usage
from vmplane.store import lifecycle

router = APIRouter(tags=["projects"], route_class=StrictQueryRoute)


@router.post("/projects", status_code=201, response_model=ProjectOut)
def create_project(body: ProjectCreate, orch: Orch, _: Admin):
    return project_out(
        orch.catalog.create_project(
            body.name,
            body.vcpus,
            body.memory_mib,
            body.vms,
            body.count_overhead,
            body.max_concurrent_migrations,
            body.storage_mib,
            body.backups_mib,
        )
    )


@router.get("/projects", response_model=list[ProjectOut])
def list_projects(orch: Orch, who: AnyCaller):
    return [project_out(p) for p in orch.catalog.projects() if who.is_admin or p.id == who.project_id]


@router.get("/projects/{name}", response_model=ProjectOut)
def show_project(name: str, orch: Orch, who: AnyCaller):
    p = orch.catalog.project(name)
    who.check_project(p.id, "project", name)
    return project_out(p)


@router.delete("/projects/{name}", status_code=204)
def delete_project(name: str, orch: Orch, _: Admin) -> None:
    """Refused (409) while the project has VMs or tokens, naming them."""
    lifecycle.delete_project(orch.catalog, name)


@router.patch("/projects/{name}/quota", response_model=ProjectOut)
def set_quota(name: str, body: QuotaUpdate, orch: Orch, _: Admin):
    return project_out(
        orch.catalog.set_quota(
            name,
            body.vcpus,
            body.memory_mib,
            body.vms,
            body.count_overhead,
            body.max_concurrent_migrations,
            body.storage_mib,
            body.backups_mib,
        )
    )


@router.get("/projects/{name}/usage", response_model=UsageOut)
def project_usage(name: str, orch: Orch, who: AnyCaller):
    who.check_project(orch.catalog.project(name).id, "project", name)
    u = orch.project_usage(name)
    return UsageOut.model_validate(
        {
            "project": name,
            "count_overhead": u["count_overhead"],
            "consistent": u["ledger"] == u["recomputed"],
            **describe_usage(u["ledger"], u["quota"]),
        }
    )
