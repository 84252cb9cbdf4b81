"""Disk images uploaded through the API (issue 30), admin only: the body streamed to the image store with
its sha256 checked, `qemu-img info` asked, then registered by name; templates are made from them
(`from_image`). Uploading a name again with the same sha256 is a no-op (so an upload can be restarted)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from anyio import to_thread
from fastapi import APIRouter, Request
from fastapi import Response as HttpResponse

from vmplane.api.deps import Admin, Orch
from vmplane.api.paging import StrictQueryRoute
from vmplane.api.schemas import Response, UtcDatetime
from vmplane.core.errors import AlreadyExists, Invalid
from vmplane.core.names import check_name
from vmplane.hosts.uploads import Stored, Upload
from vmplane.orchestrator import Orchestrator
from vmplane.store import images as IM

router = APIRouter(tags=["images"], route_class=StrictQueryRoute)

SHA256_HEADER = "x-image-sha256"
SHA256_RE = re.compile(r"[0-9a-f]{64}")
FLUSH = 1 << 20  # bytes gathered from the request before a write (one thread hop per MiB, not per chunk)
BODY = {  # (the route reads the body and the header itself: documented here)
    "parameters": [
        {
            "name": "X-Image-Sha256",
            "in": "header",
            "required": True,
            "description": "the sha256 of the file, checked against what came",
            "schema": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
        }
    ],
    "requestBody": {
        "required": True,
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    },
}


class ImageOut(Response):
    name: str
    file: str
    format: str
    virtual_mib: int
    sha256: str
    size_bytes: int
    created_at: UtcDatetime


def _sha256(request: Request) -> str:
    value = request.headers.get(SHA256_HEADER, "").strip().lower()
    if not SHA256_RE.fullmatch(value):
        raise Invalid(
            "an X-Image-Sha256 header with the file's sha256 (64 hexadecimal digits) is required", field="sha256"
        )
    return value


def _check_content_type(request: Request) -> None:
    kind = request.headers.get("content-type", "application/octet-stream").split(";")[0].strip().lower()
    if kind != "application/octet-stream":
        raise Invalid(f"the body is the image file itself (application/octet-stream), not {kind}", field="body")


def _existing(orch: Orchestrator, name: str) -> Any:
    with orch.db.read() as s:
        return IM.find(s.connection(), name)


def _same_or_conflict(row: Any, sha256: str, response: HttpResponse) -> ImageOut:
    """An upload of a name taken already: the same file is a no-op (200), another is a 409."""
    if row.sha256 != sha256:
        raise AlreadyExists(
            f"image {row.name} exists already with another sha256 ({row.sha256}); delete it first, or upload "
            f"under another name",
            field="name",
        )
    response.status_code = 200
    return ImageOut.model_validate(row)


async def _drain(request: Request) -> None:
    async for _ in request.stream():
        pass


async def _receive(request: Request, upload: Upload) -> None:
    """The body into the upload's file, a MiB at a time: memory stays flat whatever the image's size."""
    pending: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        pending.append(chunk)
        size += len(chunk)
        if size >= FLUSH:
            await to_thread.run_sync(upload.write, b"".join(pending))
            pending, size = [], 0
    if pending:
        await to_thread.run_sync(upload.write, b"".join(pending))


def _register(orch: Orchestrator, name: str, stored: Stored) -> Any:
    f = stored.facts
    with orch.db.transaction() as conn:
        return IM.register(conn, name, f.path, f.format, f.virtual_mib, f.checksum or "", stored.size)


@router.post("/images/{name}", status_code=201, response_model=ImageOut, openapi_extra=BODY)
async def upload_image(name: str, request: Request, response: HttpResponse, orch: Orch, _: Admin):
    """Upload a qcow2 or raw image: the body is the file (application/octet-stream), the `X-Image-Sha256`
    header its sha256. A body that does not match it (cut short, corrupted) is a 422 naming `sha256`, a file
    qemu-img does not take as a disk image a 422 naming `image`, with nothing registered nor kept. The same
    name and sha256 again: 200 with the image, nothing written; another sha256: 409 naming `name`."""
    check_name(name)
    sha256 = _sha256(request)
    _check_content_type(request)
    existing = await to_thread.run_sync(_existing, orch, name)
    if existing is not None:
        await _drain(request)
        return _same_or_conflict(existing, sha256, response)
    upload = await to_thread.run_sync(Upload, name)
    try:
        await _receive(request, upload)
        stored = await to_thread.run_sync(upload.finish, sha256)
    except BaseException:  # a refusal, a client gone (ClientDisconnect), a cancelled request
        upload.discard()
        raise
    try:
        return ImageOut.model_validate(await to_thread.run_sync(_register, orch, name, stored))
    except AlreadyExists:  # another upload of this name ended first
        winner = await to_thread.run_sync(_existing, orch, name)
        if stored.made and (winner is None or winner.file != stored.facts.path):
            Path(stored.facts.path).unlink(missing_ok=True)
        if winner is None:
            raise
        return _same_or_conflict(winner, sha256, response)
    except BaseException:
        if stored.made:
            Path(stored.facts.path).unlink(missing_ok=True)
        raise


@router.get("/images", response_model=list[ImageOut])
def list_images(orch: Orch, _: Admin):
    with orch.db.read() as s:
        return [ImageOut.model_validate(r) for r in IM.images(s.connection())]


@router.get("/images/{name}", response_model=ImageOut)
def show_image(name: str, orch: Orch, _: Admin):
    with orch.db.read() as s:
        return ImageOut.model_validate(IM.image(s.connection(), name))


@router.delete("/images/{name}", status_code=204)
def delete_image(name: str, orch: Orch, _: Admin) -> None:
    """Refused (409 naming `image` and the templates) while a template is made from it. Hosts' image pools
    keep their copy (VMs' root disks are overlays on it)."""
    with orch.db.transaction() as conn:
        row = IM.remove(conn, name)
    Path(row.file).unlink(missing_ok=True)
