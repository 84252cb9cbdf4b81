"""The CLI's HTTP client: one place that talks to the API and turns its errors into exceptions."""

from __future__ import annotations

import time

import httpx

from vmplane.core.errors import VmplaneError


class ApiError(VmplaneError):
    def __init__(self, status: int, body: dict):
        super().__init__(body.get("message", "error"), field=body.get("field"), code=body.get("error", "error"))
        self.status = status
        self.body = body


def _is_error_body(body) -> bool:
    return isinstance(body, dict) and isinstance(body.get("error"), str) and isinstance(body.get("message"), str)


class Client:
    def __init__(self, api: str, token: str | None, timeout: float = 30.0):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # `vmplane up` prints the base URL; the API's own URL (…/api/v1) is accepted as well
        base = api.rstrip("/").removesuffix("/api/v1")
        self.base = base
        self.http = httpx.Client(base_url=base + "/api/v1", headers=headers, timeout=timeout)

    def call(self, method: str, path: str, **kwargs):
        try:
            r = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ApiError(
                0,
                {
                    "error": "unreachable",
                    "message": f"cannot reach the vmplane API at {self.base}: {exc}; "
                    f"is `vmplane up` running? (--api / VMPLANE_API)",
                },
            ) from None
        if r.status_code == 204:
            return None
        try:
            body = r.json()
        except ValueError:
            body = None
        if r.status_code >= 400 and not _is_error_body(body):
            # every vmplane error has {"error", "message"}: anything else is another server
            raise ApiError(
                r.status_code,
                {
                    "error": "not_vmplane",
                    "field": "api",
                    "message": (
                        f"the server at {self.base} is not a vmplane API (HTTP {r.status_code} for {method} "
                        f"{r.request.url.path}: {r.text[:120].strip() or 'no body'}); check --api / VMPLANE_API"
                    ),
                },
            )
        if r.status_code >= 400:
            raise ApiError(r.status_code, body)
        if body is None:
            raise ApiError(
                r.status_code,
                {
                    "error": "not_vmplane",
                    "field": "api",
                    "message": (
                        f"the server at {self.base} answered {method} {r.request.url.path} with something that is "
                        f"not JSON; is it the vmplane API? (--api / VMPLANE_API)"
                    ),
                },
            )
        return body

    def get(self, path: str, **params):
        return self.call("GET", path, params={k: v for k, v in params.items() if v is not None})

    def get_list(self, path: str, **params) -> tuple[list, int | None]:
        """A list and its total (the X-Total-Count header; None from a server that does not send it)."""
        seen: dict = {}

        def total(response: httpx.Response) -> None:
            seen["total"] = response.headers.get("x-total-count")

        hooks = self.http.event_hooks["response"]
        hooks.append(total)
        try:
            rows = self.get(path, **params)
        finally:
            hooks.remove(total)
        return rows, int(seen["total"]) if seen.get("total") else None

    def post(self, path: str, body: dict | None = None):
        return self.call("POST", path, json=body or {})

    def wait_operation(self, op_id: str, timeout_s: float = 600.0, on_progress=None) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            op = self.get(f"/operations/{op_id}")
            if on_progress:
                on_progress(op)
            if op["state"] in ("succeeded", "failed"):
                return op
            if time.monotonic() > deadline:
                raise ApiError(
                    0, {"error": "timeout", "message": f"operation {op_id} still {op['state']} after {timeout_s:.0f} s"}
                )
            time.sleep(0.1)
