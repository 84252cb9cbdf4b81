"""The CLI's HTTP client: one place that talks to the API and turns its errors into exceptions."""

from __future__ import annotations

import time

import httpx

from .errors import VmplaneError


class ApiError(VmplaneError):
    def __init__(self, status: int, body: dict):
        super().__init__(body.get("message", "error"), field=body.get("field"), code=body.get("error", "error"))
        self.status = status
        self.body = body


class Client:
    def __init__(self, api: str, token: str | None, timeout: float = 30.0):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=api.rstrip("/") + "/api/v1", headers=headers, timeout=timeout)

    def call(self, method: str, path: str, **kwargs):
        try:
            r = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ApiError(0, {"error": "unreachable",
                               "message": f"cannot reach the vmplane API at {self.http.base_url}: {exc}; "
                                          f"is `vmplane up` running? (--api / VMPLANE_API)"}) from None
        if r.status_code == 204:
            return None
        try:
            body = r.json()
        except ValueError:
            body = {"error": "bad_response", "message": r.text[:200]}
        if r.status_code >= 400:
            raise ApiError(r.status_code, body)
        return body

    def get(self, path: str, **params):
        return self.call("GET", path, params={k: v for k, v in params.items() if v is not None})

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
                raise ApiError(0, {"error": "timeout", "message": f"operation {op_id} still {op['state']} "
                                                                  f"after {timeout_s:.0f} s"})
            time.sleep(0.1)
