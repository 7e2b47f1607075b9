"""What every route needs: the app's state, the caller's identity, and the API's error type."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.auth import Principal
from service.store import JobRecord, JobStore


class ApiError(Exception):
    """A refusal answered as {"error": code, "message": ..., "fields": [...]} with `status`."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        fields: list[tuple[str, str]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.fields = list(fields or [])
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": self.code,
            "message": self.message,
            "fields": [{"field": f, "message": m} for f, m in self.fields],
        }


@dataclass
class AppState:
    store: JobStore
    scheduler: Any | None  # service.scheduler.Scheduler; None: store-only mode, jobs stay PENDING
    max_body_bytes: int = 1 << 20
    cluster_total: dict[str, float] | None = None  # a fixed view for store-only servers (tests, docs)
    extra: dict[str, Any] = field(default_factory=dict)


def get_state(request: Request) -> AppState:
    return request.app.state.unbroken  # type: ignore[no-any-return]


bearer = HTTPBearer(auto_error=False, description="a token from `unbroken serve` (~/.unbroken/token)")


def current_principal(
    request: Request,
    creds: HTTPAuthorizationCredentials | None = Depends(bearer),
    state: AppState = Depends(get_state),
) -> Principal:
    challenge = {"WWW-Authenticate": "Bearer"}
    if creds is None or not creds.credentials:
        raise ApiError(
            401, "unauthorized",
            "missing bearer token: send 'Authorization: Bearer <token>' (the local server writes one to "
            "~/.unbroken/token; the SDK and CLI read it by default)",
            headers=challenge,
        )
    principal = state.store.principal_for_token(creds.credentials)
    if principal is None:
        raise ApiError(401, "unauthorized", "the bearer token is not valid (unknown or revoked)", headers=challenge)
    request.state.principal = principal
    return principal


def visible_job(job_id: str, principal: Principal, state: AppState) -> JobRecord:
    """The job if it exists and this caller may see it; else 404 (another user's job is not revealed)."""
    job = state.store.get_job(job_id) if len(job_id) <= 64 else None
    if job is None or not principal.can_see(job.owner):
        raise ApiError(404, "not_found", f"no job {job_id!r} visible to {principal.name!r}")
    return job
