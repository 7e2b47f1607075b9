"""The FastAPI app factory: routes, auth, error shape, body limit, request metrics, OpenAPI.

`create_app(store, scheduler)` with a Scheduler admits and runs jobs on Ray; with
`scheduler=None` the server is "store only": jobs are validated, stored and served, and stay
PENDING (used by API tests and benchmarks, and by a control plane without a cluster).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import body_limits
from api.auth_limits import FailedAuthLimiter
from api.deps import ApiError, AppState
from api.routers import audit, cluster, health, jobs, metrics, plan, tokens, ui
from service.store import RETRY_AFTER_S, JobStore, store_unavailable
from service.submission import SubmissionRefused

log = logging.getLogger(__name__)


class BodyTooLarge(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, "payload_too_large", f"the request body exceeds {limit} bytes; send a smaller job spec",
                         [("body", f"at most {limit} bytes")])


MUTATING = ("POST", "PUT", "PATCH", "DELETE")
YAML_TYPES = (b"application/yaml", b"application/x-yaml", b"text/yaml", b"text/x-yaml")


def _structure_problem(body: bytes, content_type: bytes) -> body_limits.LimitExceeded | None:
    ctype = content_type.split(b";")[0].strip().lower()
    if ctype in YAML_TYPES:
        return body_limits.check_yaml(body)
    return body_limits.check_json(body)


class LimitsAndMetrics:
    """Pure ASGI middleware: refuses bodies over the size limit (413) or over the structure limits
    (api.body_limits: depth, YAML aliases and expansion) before any route parses them, records
    count and latency, and writes an audit entry for every mutating request."""

    def __init__(self, app: ASGIApp, state: AppState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.state.max_body_bytes
        start = time.perf_counter()
        status = 500
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            err = BodyTooLarge(limit)
            await self._audit(scope, 413)
            await JSONResponse(err.body(), status_code=413)(scope, receive, send)
            self._observe(scope, 413, start)
            return
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            body, more = b"", True
            while more:
                msg = await receive()
                if msg["type"] != "http.request":
                    return  # the client went away
                body += msg.get("body", b"")
                more = bool(msg.get("more_body"))
                if len(body) > limit:
                    err = BodyTooLarge(limit)
                    await self._audit(scope, 413)
                    await JSONResponse(err.body(), status_code=413)(scope, receive, send)
                    self._observe(scope, 413, start)
                    return
            problem = _structure_problem(body, headers.get(b"content-type", b"")) if body else None
            if problem is not None:
                code = "payload_too_large" if problem.status == 413 else "validation_failed"
                err = ApiError(problem.status, code, problem.message, [("body", problem.message)])
                await self._audit(scope, problem.status)
                await JSONResponse(err.body(), status_code=problem.status)(scope, receive, send)
                self._observe(scope, problem.status, start)
                return
            replayed = False
            outer_receive = receive

            async def replay() -> Message:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await outer_receive()

            receive = replay
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return msg

        audited = False

        async def send_status(msg: Message) -> None:
            nonlocal status, audited
            if msg["type"] == "http.response.start":
                status = int(msg["status"])
            elif msg["type"] == "http.response.body" and not msg.get("more_body") and not audited:
                # Written before the last byte leaves, so a client that has its answer finds the entry.
                audited = True
                await self._audit(scope, status)
            await send(msg)

        try:
            await self.app(scope, limited_receive, send_status)
        finally:
            self._observe(scope, status, start)
            if not audited:
                await self._audit(scope, status)

    async def _audit(self, scope: Scope, status: int) -> None:
        if scope.get("method") not in MUTATING:
            return
        who = getattr((scope.get("state") or {}).get("principal"), "name", "-")
        client = (scope.get("client") or ("-",))[0]
        path = scope.get("path", "")
        try:
            await anyio.to_thread.run_sync(self.state.store.add_audit, who, client, scope["method"], path, status)
        except Exception as e:  # the store is down: the request itself was answered 503 already
            log.warning("audit entry for %s %s by %s (%s) not written: %s", scope["method"], path, who, status, e)

    def _observe(self, scope: Scope, status: int, start: float) -> None:
        route = scope.get("route")
        path = getattr(route, "path", None) or "(unmatched)"
        self.state.extra["metrics"].observe(scope.get("method", ""), path, status, time.perf_counter() - start)


def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _submission_refused(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, SubmissionRefused)
    return JSONResponse(ApiError(422, "validation_failed", exc.message, exc.problems).body(), status_code=422)


def _request_validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    fields = []
    for e in exc.errors():
        loc = [str(p) for p in e.get("loc", ())]
        fields.append((".".join(loc) or "(request)", str(e.get("msg", "invalid")).removeprefix("Value error, ")))
    msg = "invalid request: " + "; ".join(f"{f}: {m}" for f, m in fields)
    return JSONResponse(ApiError(422, "validation_failed", msg, fields).body(), status_code=422)


def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return JSONResponse(ApiError(exc.status_code, code, str(exc.detail)).body(), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


def _store_error(request: Request, exc: Exception) -> JSONResponse:
    """The job store cannot be reached: 503 with Retry-After (clients retry), not 500."""
    assert isinstance(exc, DBAPIError)
    if not store_unavailable(exc):
        return _unexpected(request, exc)
    log.warning("job store unavailable: %s", exc.orig)
    err = ApiError(503, "store_unavailable", f"the job store is unavailable ({type(exc.orig).__name__}); "
                   f"nothing was changed by this request unless it says otherwise; retry in {RETRY_AFTER_S} s")
    return JSONResponse(err.body(), status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})


def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    body = ApiError(500, "internal", f"internal error ({type(exc).__name__}); see the server log").body()
    return JSONResponse(body, status_code=500)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the JobSpec body of POST /v1/jobs (read by hand to accept YAML too)."""
    if app.openapi_schema:
        return app.openapi_schema
    from service.spec import JobSpec

    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    spec_schema = JobSpec.model_json_schema(ref_template="#/components/schemas/{model}")
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    comps.update(spec_schema.pop("$defs", {}))
    comps["JobSpec"] = spec_schema
    app.openapi_schema = schema
    return schema


def create_app(
    store: JobStore,
    scheduler: Any | None = None,
    *,
    max_body_bytes: int = 1 << 20,
    cluster_total: dict[str, float] | None = None,
    auth_limiter: FailedAuthLimiter | None = None,
) -> FastAPI:
    """The REST API over `store`; `scheduler` (service.scheduler.Scheduler) runs jobs, None stores only.

    `cluster_total` lets a store-only server refuse jobs larger than a known cluster. `auth_limiter`
    bounds failed authentications per client (default: 30 a minute).
    """
    from api.routers.metrics import ApiMetrics

    app = FastAPI(
        title="Unbroken",
        version="1",
        description="Elastic, fault-tolerant LLM training jobs on Ray. Authenticate with `Authorization: Bearer`.",
    )
    state = AppState(store=store, scheduler=scheduler, max_body_bytes=max_body_bytes, cluster_total=cluster_total)
    state.extra["metrics"] = ApiMetrics(store, scheduler)
    state.extra["auth_limiter"] = auth_limiter or FailedAuthLimiter()
    app.state.unbroken = state
    app.include_router(jobs.router)
    app.include_router(plan.router)
    app.include_router(health.router)
    app.include_router(metrics.router)
    app.include_router(cluster.router)
    app.include_router(tokens.router)
    app.include_router(audit.router)
    ui.install(app, state)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(SubmissionRefused, _submission_refused)
    app.add_exception_handler(RequestValidationError, _request_validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(DBAPIError, _store_error)
    app.add_exception_handler(Exception, _unexpected)
    app.add_middleware(LimitsAndMetrics, state=state)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app
