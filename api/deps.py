"""What every route needs: the app's state, the caller's identity, and the API's error type."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import APIKeyCookie, HTTPAuthorizationCredentials, HTTPBearer

from api.auth_limits import FailedAuthLimiter
from api.ui.sessions import COOKIE, CSRF_HEADER, Session, Sessions, csrf_problem
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

    def cluster_view(self) -> dict[str, float] | None:
        """The cluster's resources: the connected Ray cluster's, or a store-only server's fixed view."""
        return self.scheduler.cluster_total() if self.scheduler is not None else self.cluster_total


def get_state(request: Request) -> AppState:
    return request.app.state.unbroken  # type: ignore[no-any-return]


bearer = HTTPBearer(auto_error=False, description="a token from `unbroken serve` (~/.unbroken/token)")
session_cookie = APIKeyCookie(
    name=COOKIE, auto_error=False,
    description=f"the web console's session (log in at /ui/login); changes also need the {CSRF_HEADER} header",
)


def session_principal(state: AppState, session_id: str | None) -> tuple[Session, Principal] | None:
    """The console session behind a cookie and whom it acts for; None if ended or its token revoked."""
    sessions: Sessions | None = state.extra.get("sessions")
    sess = sessions.get(session_id) if sessions is not None else None
    if sess is None:
        return None
    principal = state.store.principal_for_token(sess.token)
    return None if principal is None else (sess, principal)


def client_address(request: Request) -> str:
    return request.client.host if request.client is not None else "-"


def current_principal(
    request: Request,
    creds: HTTPAuthorizationCredentials | None = Depends(bearer),
    session_id: str | None = Depends(session_cookie),
    state: AppState = Depends(get_state),
) -> Principal:
    limiter: FailedAuthLimiter | None = state.extra.get("auth_limiter")
    client = client_address(request)
    if limiter is not None:
        wait = limiter.retry_after(client)
        if wait is not None:
            raise ApiError(429, "too_many_failed_authentications",
                           f"too many failed authentications from {client}: at most {limiter.max_failures} in "
                           f"{limiter.window_s:.0f} s; retry after {wait} s with a valid token",
                           headers={"Retry-After": str(wait)})
    try:
        return _authenticate(request, creds, session_id, state)
    except ApiError as e:
        if e.status == 401 and limiter is not None:
            limiter.failed(client)
        raise


def _authenticate(
    request: Request, creds: HTTPAuthorizationCredentials | None, session_id: str | None, state: AppState,
) -> Principal:
    challenge = {"WWW-Authenticate": "Bearer"}
    if (creds is None or not creds.credentials) and session_id:
        found = session_principal(state, session_id)
        if found is None:
            raise ApiError(401, "unauthorized", "the console session has ended (logged out, expired or its token "
                           "revoked); log in again at /ui/login", headers=challenge)
        sess, principal = found
        why = csrf_problem(request, sess, request.headers.get(CSRF_HEADER))
        if why is not None:
            raise ApiError(403, "forbidden", why, [(CSRF_HEADER, why)])
        request.state.principal = principal
        return principal
    if creds is None or not creds.credentials:
        raise ApiError(
            401, "unauthorized",
            "missing bearer token: send 'Authorization: Bearer <token>' (the local server writes one to "
            "~/.unbroken/token; the SDK and CLI read it by default)",
            headers=challenge,
        )
    principal = state.store.principal_for_token(creds.credentials)
    if principal is None:
        raise ApiError(401, "unauthorized", "the bearer token is not valid (unknown, expired or revoked); ask an "
                       "admin for a new one (`unbroken token create`)", headers=challenge)
    request.state.principal = principal
    return principal


def visible_job(job_id: str, principal: Principal, state: AppState) -> JobRecord:
    """The job if it exists and this caller may see it; else 404 (another user's job is not revealed)."""
    job = state.store.get_job(job_id) if len(job_id) <= 64 else None
    if job is None or not principal.can_see(job.owner):
        raise ApiError(404, "not_found", f"no job {job_id!r} visible to {principal.name!r}")
    return job


# Dependency aliases for routes: `state: State`, `principal: Caller`, and `job: VisibleJob` (a route
# with {job_id} in its path gets the job this caller may see, or answers 404 before it runs).
State = Annotated[AppState, Depends(get_state)]
Caller = Annotated[Principal, Depends(current_principal)]


def _admin_dep(principal: Caller) -> Principal:
    if not principal.is_admin:
        raise ApiError(403, "forbidden", f"{principal.name!r} is not an admin; only admins manage tokens and read "
                       "the audit log")
    return principal


AdminCaller = Annotated[Principal, Depends(_admin_dep)]


def _visible_job_dep(job_id: str, principal: Caller, state: State) -> JobRecord:
    return visible_job(job_id, principal, state)


VisibleJob = Annotated[JobRecord, Depends(_visible_job_dep)]
