"""Typed errors of the SDK, one per way the API refuses a request.

The server answers every refusal with {"error": code, "message": text, "fields": [...]};
`error_from_response` turns that into the matching exception. Light: no torch, no ray, no httpx.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from api.schemas import Job


class UnbrokenError(Exception):
    """Base of every error the SDK raises for a refused request."""

    status: int = 0
    code: str = "error"

    def __init__(self, message: str, *, status: int | None = None, body: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        self.body = body or {}


class Unauthorized(UnbrokenError):
    """401: no token, or a token the server does not know."""

    status, code = 401, "unauthorized"


class Forbidden(UnbrokenError):
    """403: the token is valid but may not do this."""

    status, code = 403, "forbidden"


class JobNotFound(UnbrokenError):
    """404: no such job, or not one this token may see."""

    status, code = 404, "not_found"


class Conflict(UnbrokenError):
    """409: the job's state forbids this (deleting a running job, reusing an idempotency key)."""

    status, code = 409, "conflict"


class ValidationFailed(UnbrokenError):
    """422 (or 413/400): the request or job spec is invalid; `fields` maps each bad field to why."""

    status, code = 422, "validation_failed"

    def __init__(
        self,
        message: str,
        fields: dict[str, str] | None = None,
        *,
        status: int | None = None,
        body: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message, status=status, body=body)
        self.fields: dict[str, str] = dict(fields or {})

    def __str__(self) -> str:
        if not self.fields:
            return self.message
        return self.message + "\n" + "\n".join(f"  {k}: {v}" for k, v in self.fields.items())


class ServerError(UnbrokenError):
    """5xx, or an answer that is not the API's JSON."""

    code = "server_error"


def error_from_response(status: int, body: Any, text: str = "") -> UnbrokenError:
    data = body if isinstance(body, dict) else {}
    message = str(data.get("message") or text or f"HTTP {status}")
    if status == 401:
        return Unauthorized(message, status=status, body=data)
    if status == 403:
        return Forbidden(message, status=status, body=data)
    if status == 404:
        return JobNotFound(message, status=status, body=data)
    if status == 409:
        return Conflict(message, status=status, body=data)
    if status in (400, 413, 422):
        fields: dict[str, str] = {}
        for f in data.get("fields") or []:
            if isinstance(f, dict):
                key, msg = str(f.get("field")), str(f.get("message"))
                fields[key] = f"{fields[key]}; {msg}" if key in fields else msg
        return ValidationFailed(message, fields, status=status, body=data)
    return ServerError(message, status=status, body=data)


class JobFailed(UnbrokenError):
    """Client.wait(): the job ended FAILED. `.job` is the final job, `.reason` the server's reason."""

    code = "job_failed"

    def __init__(self, job: Job) -> None:
        self.job = job
        self.reason: str | None = job.reason
        super().__init__(f"job {job.id} ({job.name}) FAILED: {job.reason or 'no reason recorded'}")


class JobCancelled(UnbrokenError):
    """Client.wait(): the job ended CANCELLED (as concurrent.futures raises CancelledError). Not a
    JobFailed: nothing went wrong, someone asked. `.job` is the final job, `.reason` why."""

    code = "job_cancelled"

    def __init__(self, job: Job) -> None:
        self.job = job
        self.reason: str | None = job.reason
        super().__init__(f"job {job.id} ({job.name}) was CANCELLED" + (f": {job.reason}" if job.reason else ""))


class ServerUnavailable(UnbrokenError):
    """The API could not be reached at all."""

    code = "unavailable"
