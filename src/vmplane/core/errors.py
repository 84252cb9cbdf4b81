"""The one exception type of vmplane; the API maps it once to {"error", "message", "field"}."""

from __future__ import annotations


class VmplaneError(Exception):
    """A refusal or failure a user can act on. `code` is stable, `message` is for people."""

    status = 400
    code = "bad_request"

    def __init__(self, message: str, field: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        if code:
            self.code = code

    def as_dict(self) -> dict[str, str | None]:
        return {"error": self.code, "message": self.message, "field": self.field or None}


class Invalid(VmplaneError):
    status = 422
    code = "invalid"


class NotFound(VmplaneError):
    status = 404
    code = "not_found"


class AlreadyExists(VmplaneError):
    status = 409
    code = "already_exists"


class Conflict(VmplaneError):
    """The request is valid but the current state forbids it (wrong VM state, in use...)."""

    status = 409
    code = "conflict"


class QuotaExceeded(VmplaneError):
    status = 409
    code = "quota_exceeded"


class InsufficientCapacity(VmplaneError):
    status = 409
    code = "insufficient_capacity"


class Unauthorized(VmplaneError):
    status = 401
    code = "unauthorized"


class Forbidden(VmplaneError):
    status = 403
    code = "forbidden"


class Interrupted(Exception):
    """The control plane is shutting down in the middle of an operation: it stays in flight, at its
    persisted step, and the next start resumes it. Never shown to API callers."""
