"""/v1/jobs: submit, read, list, cancel, delete, and a job's events, metrics, logs, checkpoints."""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Annotated, Any, TypeVar

import yaml
from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from api import schemas
from api.deps import ApiError, AppState, Caller, State, VisibleJob
from service import submission
from service.goodput import job_goodput
from service.statuses import CANCELLED, STATUSES, TERMINAL
from service.store import IdempotencyConflictError, JobNotTerminalError, JobRecord, JobStore, LogRecord

router = APIRouter(prefix="/v1", tags=["jobs"])
T = TypeVar("T")

JSON_TYPES = ("application/json", "")
YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml")
ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": schemas.ErrorBody, "description": "missing or invalid token"},
    404: {"model": schemas.ErrorBody, "description": "no such job visible to this token"},
    422: {"model": schemas.ErrorBody, "description": "invalid input; `fields` names each bad field"},
}


def job_out(rec: JobRecord, *, with_spec: bool = True) -> schemas.Job:
    p = rec.progress or {}
    steps = p.get("total_steps")
    if steps is None and rec.spec is not None:
        steps = (rec.spec.get("training") or {}).get("steps")
    progress = schemas.Progress(
        step=p.get("step"),
        total_steps=steps,
        loss=p.get("loss"),
        eval_loss=p.get("eval_loss"),
        tokens_per_s=p.get("tokens_per_s"),
        dp=p.get("dp"),
        target_dp=rec.target_dp,
        world_size=p.get("world_size"),
        generation=p.get("generation"),
        recoveries=rec.recoveries,
        spares=p.get("spares"),
    )
    return schemas.Job(
        id=rec.id, name=rec.name, owner=rec.owner, status=rec.status, reason=rec.reason,  # type: ignore[arg-type]
        priority=rec.priority, min_world=rec.min_world, max_world=rec.max_world, created_at=rec.created_at,
        updated_at=rec.updated_at, admitted_at=rec.admitted_at, started_at=rec.started_at,
        finished_at=rec.finished_at, cancel_requested=rec.cancel_requested, progress=progress,
        spec=rec.spec if with_spec else None,
    )


def _parse_body(raw: bytes, content_type: str) -> Any:
    ctype = content_type.split(";")[0].strip().lower()
    if ctype in YAML_TYPES:
        try:
            return yaml.safe_load(raw.decode("utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ApiError(422, "validation_failed", f"the body is not valid YAML: {e}", [("body", str(e))]) from e
    if ctype in JSON_TYPES or ctype.endswith("+json"):
        if not raw.strip():
            raise ApiError(422, "validation_failed", "the body is empty; send a job spec as JSON or YAML",
                           [("body", "empty")])
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(422, "validation_failed", f"the body is not valid JSON: {e}", [("body", str(e))]) from e
    raise ApiError(
        415, "unsupported_media_type",
        f"Content-Type {ctype!r} is not accepted; send application/json or application/yaml",
    )


SUBMIT_OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "a job spec (the sections of a job.yaml), as JSON or YAML",
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/JobSpec"}},
            "application/yaml": {"schema": {"$ref": "#/components/schemas/JobSpec"}},
        },
    }
}


@router.post(
    "/jobs",
    status_code=201,
    response_model=schemas.Job,
    openapi_extra=SUBMIT_OPENAPI,
    responses={**ERRORS, 200: {"model": schemas.Job, "description": "an Idempotency-Key replay: the stored job"},
               409: {"model": schemas.ErrorBody, "description": "Idempotency-Key reused with another spec"},
               413: {"model": schemas.ErrorBody, "description": "body too large"}},
    summary="Submit a job",
)
async def submit_job(
    request: Request,
    principal: Caller,
    state: State,
    idempotency_key: Annotated[str | None, Header(max_length=255)] = None,
) -> Response:
    data = _parse_body(await request.body(), request.headers.get("content-type", ""))
    try:
        done = await run_in_threadpool(submission.submit, state.store, state.scheduler, data, principal.name,
                                       cluster_total=state.cluster_view(), idempotency_key=idempotency_key)
    except IdempotencyConflictError as e:
        raise ApiError(409, "conflict", str(e), [("Idempotency-Key", "reused with a different spec")]) from e
    headers = {"Location": f"/v1/jobs/{done.job.id}"}
    if not done.created:
        headers["Idempotent-Replayed"] = "true"
    est = done.estimate
    body = job_out(done.job).model_copy(update={
        "estimate": schemas.RunEstimate(**est.to_dict()) if est else None, "warnings": done.warnings})
    return JSONResponse(body.model_dump(mode="json"), status_code=201 if done.created else 200, headers=headers)


@router.get("/jobs", response_model=schemas.JobList, responses=ERRORS, summary="List jobs, newest first")
def list_jobs(
    principal: Caller,
    state: State,
    status: Annotated[list[str] | None, Query(description="repeat or comma-separate: ?status=RUNNING,PENDING")] = None,
    owner: Annotated[str | None, Query(max_length=128)] = None,
    name: Annotated[str | None, Query(max_length=128)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=64)] = None,
) -> schemas.JobList:
    statuses = [s.strip().upper() for v in status or [] for s in v.split(",") if s.strip()]
    bad = [s for s in statuses if s not in STATUSES]
    if bad:
        raise ApiError(422, "validation_failed", f"unknown status {bad}; use one of {list(STATUSES)}",
                       [("status", f"must be one of {list(STATUSES)}")])
    if owner is not None and not principal.is_admin and owner != principal.name:
        raise ApiError(403, "forbidden", f"{principal.name!r} may list only its own jobs; drop ?owner= or ask an admin")
    if not principal.is_admin:
        owner = principal.name
    try:
        page, nxt = state.store.list_jobs(owner=owner, status=statuses or None, name=name, limit=limit,
                                          cursor=cursor)
    except ValueError as e:
        raise ApiError(422, "validation_failed", str(e), [("cursor", str(e))]) from e
    return schemas.JobList(items=[job_out(r, with_spec=False) for r in page], next_cursor=nxt)


@router.get("/jobs/{job_id}", response_model=schemas.Job, responses=ERRORS, summary="One job, with its spec")
def get_job(job: VisibleJob) -> schemas.Job:
    return job_out(job)


@router.post(
    "/jobs/{job_id}/cancel", response_model=schemas.Job,
    responses={**ERRORS, 409: {"model": schemas.ErrorBody, "description": "the job already finished"}},
    summary="Cancel a job (queued: at once; running: its supervisor stops it)",
)
def cancel_job(job_id: str, job: VisibleJob, state: State) -> schemas.Job:
    if job.status in TERMINAL - {CANCELLED}:
        raise ApiError(409, "conflict", f"job {job_id} already finished ({job.status}); nothing to cancel")
    if job.status == CANCELLED:
        return job_out(job)
    if state.scheduler is not None:
        return job_out(state.scheduler.cancel(job_id))
    # Store-only: no supervisor runs anything, so cancelling is only a state change.
    state.store.request_cancel(job_id)
    state.store.set_status(job_id, CANCELLED, "cancelled (no scheduler: the job never ran)")
    got = state.store.get_job(job_id)
    assert got is not None
    return job_out(got)


@router.delete(
    "/jobs/{job_id}", status_code=204,
    responses={**ERRORS, 409: {"model": schemas.ErrorBody, "description": "the job has not finished"}},
    summary="Delete a finished job and its records",
)
def delete_job(job_id: str, _job: VisibleJob, state: State) -> Response:
    try:
        state.store.delete_job(job_id)
    except JobNotTerminalError as e:
        raise ApiError(409, "conflict", str(e)) from e
    except KeyError as e:
        raise ApiError(404, "not_found", f"no job {job_id!r}") from e
    return Response(status_code=204)


KEEP_ALIVE_S = 15.0  # a comment line on an idle stream, so proxies do not close it
FOLLOW_LINGER_S = 2.0  # a followed log or metrics stream ends this long after its job did
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _resume_point(request: Request, after: int) -> int:
    """`after`, or the id a reconnecting EventSource names in Last-Event-ID when that is later."""
    last_event_id = request.headers.get("last-event-id", "")
    if last_event_id.isdigit() and len(last_event_id) < 19:
        return max(after, int(last_event_id))
    return after


def _follow(
    request: Request,
    state: AppState,
    job_id: str,
    read: Callable[[int], Sequence[T]],
    frame: Callable[[T], tuple[int, str]],
    cursor: int,
    poll_s: float,
    linger_s: float = 0.0,
) -> StreamingResponse:
    """Server-Sent Events of what a job stores, as it is stored, until the job ends.

    `read(cursor)` answers the items after `cursor` (a batch, oldest first); `frame(item)` gives the
    item's cursor and its SSE frame. The stream ends with an `end` event once the job has been
    finished for `linger_s` (its last rows or lines may be written just after its final status)."""

    async def stream() -> AsyncIterator[str]:
        at = cursor
        last_beat = time.monotonic()
        while True:
            items = await run_in_threadpool(read, at)
            for x in items:
                at, text = frame(x)
                yield text
            if items:
                continue  # more may be waiting
            job = await run_in_threadpool(state.store.get_job, job_id)
            if job is None or job.terminal and time.time() - (job.finished_at or 0.0) > linger_s:
                # Drain what was written between the last read and the read of the status.
                while items := await run_in_threadpool(read, at):
                    for x in items:
                        at, text = frame(x)
                        yield text
                yield "event: end\ndata: {}\n\n"
                return
            if time.monotonic() - last_beat > KEEP_ALIVE_S:
                last_beat = time.monotonic()
                yield ": keep-alive\n\n"
            if await request.is_disconnected():
                return
            await asyncio.sleep(poll_s)

    return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)


def _event_frame(ev: Any) -> tuple[int, str]:
    payload = schemas.JobEvent(id=ev.id, job_id=ev.job_id, ts=ev.ts, kind=ev.kind, message=ev.message,
                               data=ev.data).model_dump_json()
    return ev.id, f"id: {ev.id}\nevent: {ev.kind}\ndata: {payload}\n\n"


@router.get(
    "/jobs/{job_id}/events", response_model=schemas.EventList,
    responses={**ERRORS, 200: {"content": {"text/event-stream": {}},
                               "description": "JSON list, or with ?follow=true Server-Sent Events"}},
    summary="A job's events; ?follow=true streams them (SSE) until the job finishes",
)
async def job_events(
    request: Request,
    job_id: str,
    _job: VisibleJob,
    state: State,
    after: Annotated[int, Query(ge=0, le=2**62, description="only events with a larger id")] = 0,
    limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
    follow: bool = False,
    poll_s: Annotated[float, Query(ge=0.05, le=10.0)] = 0.25,
) -> Any:
    after = _resume_point(request, after)
    if not follow:
        evs = await run_in_threadpool(state.store.events, job_id, after, limit)
        return schemas.EventList(items=[schemas.JobEvent(**ev.__dict__) for ev in evs])
    return _follow(request, state, job_id, lambda at: state.store.events(job_id, at, limit), _event_frame,
                   after, poll_s)


def _metrics_frame(row: dict[str, Any]) -> tuple[int, str]:
    step = int(row["step"])
    return step, f"id: {step}\nevent: metrics\ndata: {json.dumps(row, separators=(',', ':'))}\n\n"


@router.get(
    "/jobs/{job_id}/metrics", response_model=schemas.MetricsList,
    responses={**ERRORS, 200: {"content": {"text/event-stream": {}},
                               "description": "JSON list, or with ?follow=true Server-Sent Events: one `metrics` "
                                              "event a row, its id the row's step"}},
    summary="A job's metrics, one row a step; ?follow=true streams new rows (SSE) until the job finishes",
)
async def job_metrics(
    request: Request,
    job_id: str,
    _job: VisibleJob,
    state: State,
    after_step: Annotated[int, Query(ge=-1, le=2**31, description="only rows of a later step")] = -1,
    limit: Annotated[int, Query(ge=1, le=100000)] = 10000,
    follow: bool = False,
    poll_s: Annotated[float, Query(ge=0.05, le=10.0)] = 0.25,
) -> Any:
    if not follow:
        return schemas.MetricsList(items=await run_in_threadpool(state.store.metrics, job_id, after_step, limit))
    # A reconnecting EventSource names the last step it saw.
    after_step = _resume_point(request, after_step)
    return _follow(request, state, job_id, lambda at: state.store.metrics(job_id, at, limit), _metrics_frame,
                   after_step, poll_s, FOLLOW_LINGER_S)


def _log_line(x: LogRecord) -> schemas.LogLine:
    return schemas.LogLine(id=x.id, ts=x.ts, source=x.source, line=x.line)


def _log_frame(x: LogRecord) -> tuple[int, str]:
    return x.id, f"id: {x.id}\nevent: log\ndata: {_log_line(x).model_dump_json()}\n\n"


LOG_PAGE = 10000  # lines a read of the store takes while looking for a tail


def _log_tail(store: JobStore, job_id: str, after: int, n: int) -> list[LogRecord]:
    """The newest `n` lines after id `after`, oldest first. The store reads lines oldest first only,
    so this pages through them here (a job keeps at most the store's max_log_lines), not the browser."""
    tail: deque[LogRecord] = deque(maxlen=n)
    while page := store.logs(job_id, after, LOG_PAGE):
        tail.extend(page)
        after = page[-1].id
        if len(page) < LOG_PAGE:
            break
    return list(tail)


@router.get(
    "/jobs/{job_id}/logs", response_model=schemas.LogList,
    responses={**ERRORS, 200: {"content": {"text/event-stream": {}},
                               "description": "JSON list, or with ?follow=true Server-Sent Events"}},
    summary="A job's log lines; ?tail=N the newest N; ?follow=true streams new ones (SSE) until the job finishes",
)
async def job_logs(
    request: Request,
    job_id: str,
    _job: VisibleJob,
    state: State,
    after: Annotated[int, Query(ge=0, le=2**62, description="only lines with a larger id")] = 0,
    limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
    tail: Annotated[int | None, Query(ge=1, le=10000, description=(
        "only the newest N lines (of those after `after`), instead of the oldest `limit`; with "
        "follow=true the stream starts with them"))] = None,
    follow: bool = False,
    poll_s: Annotated[float, Query(ge=0.05, le=10.0)] = 0.25,
) -> Any:
    after = _resume_point(request, after)
    if tail is not None:
        lines = await run_in_threadpool(_log_tail, state.store, job_id, after, tail)
        if follow:
            # Start just before the tail's first line: no line of this job lies between the two ids.
            after = lines[0].id - 1 if lines else after
        else:
            return schemas.LogList(items=[_log_line(x) for x in lines], next_after=lines[-1].id if lines else after)
    if not follow:
        lines = await run_in_threadpool(state.store.logs, job_id, after, limit)
        return schemas.LogList(items=[_log_line(x) for x in lines], next_after=lines[-1].id if lines else after)
    return _follow(request, state, job_id, lambda at: state.store.logs(job_id, at, limit), _log_frame, after,
                   poll_s, FOLLOW_LINGER_S)


@router.get("/jobs/{job_id}/checkpoints", response_model=schemas.CheckpointList, responses=ERRORS,
            summary="A job's checkpoints (both tiers), oldest first")
def job_checkpoints(job_id: str, _job: VisibleJob, state: State) -> schemas.CheckpointList:
    return schemas.CheckpointList(items=[schemas.Checkpoint(**c.__dict__) for c in state.store.checkpoints(job_id)])


@router.get("/jobs/{job_id}/goodput", response_model=schemas.Goodput, responses=ERRORS,
            summary="How much of a job's wall time since its first step went into steps, and what paused it")
def job_goodput_of(job_id: str, _job: VisibleJob, state: State) -> schemas.Goodput:
    g = job_goodput(state.store, job_id)
    return schemas.Goodput(steps=g.steps, wall_s=g.wall_s, step_s=g.step_s, paused_s=g.paused_s, other_s=g.other_s,
                           ratio=g.ratio, pauses=g.pauses, paused_by_cause=g.by_cause, lost_steps=g.lost_steps,
                           summary=g.summary())
