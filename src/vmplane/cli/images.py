"""`vmplane image upload|list|show|delete`: disk images uploaded to the control plane (issue 30), from which
templates are made (`template create NAME --from-image IMAGE`)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from vmplane.cli.client import ApiError, Client
from vmplane.cli.common import api_command, app
from vmplane.cli.output import Col, err_console, note
from vmplane.core.errors import Invalid
from vmplane.core.names import check_name

image_app = typer.Typer(help="Disk images uploaded to the control plane (templates are made from them).")
app.add_typer(image_app, name="image")
IMAGE_COLUMNS = ["name", "format", Col("virtual MiB", "virtual_mib"), Col("bytes", "size_bytes"), "created_at"]
CHUNK = 1 << 20
# the server checks the file (fsync, sha256, qemu-img) after the last byte before it answers
UPLOAD_TIMEOUT = httpx.Timeout(30.0, read=600.0)


def _bar(output: str) -> Progress:
    return Progress(
        TextColumn("{task.description:<9}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=err_console,
        disable=output == "json",
    )


def _chunks(file: Path, bar: Progress, what: str) -> Iterator[bytes]:
    task = bar.add_task(what, total=file.stat().st_size)
    with open(file, "rb") as f:
        while chunk := f.read(CHUNK):
            bar.advance(task, len(chunk))
            yield chunk


def _sha256(file: Path, bar: Progress) -> str:
    digest = hashlib.sha256()
    for chunk in _chunks(file, bar, "sha256"):
        digest.update(chunk)
    return digest.hexdigest()


def _uploaded(client: Client, name: str) -> dict | None:
    try:
        return client.get(f"/images/{name}")
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise


@api_command(image_app, "upload")
def image_upload(
    name: str,
    file: Path = typer.Argument(..., exists=True, dir_okay=False, readable=True, help="a qcow2 or raw disk image"),
    *,
    client: Client,
    output: str,
):
    """Upload an image (its sha256 first, then the file, streamed); the server checks both and qemu-img's
    view of it. Uploading it again after a failure starts over; after a success it is a no-op."""
    try:  # before the file is read: a server refuses a bad name before it reads the body
        check_name(name)
    except Invalid as exc:
        raise ApiError(422, exc.as_dict()) from None
    with _bar(output) as bar:
        sha256 = _sha256(file, bar)
        there = _uploaded(client, name)
        if there is not None and there["sha256"] == sha256:
            note(f"image {name} is uploaded already (same sha256)")
            return there
        if there is not None:  # the server would refuse it (409) once the whole file came
            raise ApiError(
                409,
                {
                    "error": "already_exists",
                    "field": "name",
                    "message": f"image {name} exists already with another sha256 ({there['sha256']}); "
                    f"delete it first, or upload under another name",
                },
            )
        client.http.timeout = UPLOAD_TIMEOUT
        return client.call(
            "POST",
            f"/images/{name}",
            content=_chunks(file, bar, "upload"),
            headers={
                "Content-Type": "application/octet-stream",
                "Content-Length": str(file.stat().st_size),
                "X-Image-Sha256": sha256,
            },
        )


@api_command(image_app, "list", lists=True)
def image_list(client: Client):
    """Uploaded images."""
    return client.get("/images"), IMAGE_COLUMNS, "images"


@api_command(image_app, "show")
def image_show(name: str, client: Client):
    """Show one image (its file in the image store, format, sizes, sha256)."""
    return client.get(f"/images/{name}")


@api_command(image_app, "delete")
def image_delete(name: str, client: Client):
    """Delete an image (refused while a template is made from it)."""
    client.call("DELETE", f"/images/{name}")
    note(f"image {name} deleted")
