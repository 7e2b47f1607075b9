"""POST /v1/plan: which layouts of a job fit a cluster, how fast each should run, and why others don't.

The body is a job spec, as for POST /v1/jobs (JSON or YAML, the same 422s). The cluster is the
query's gpus/gpu/nodes, else the one the job would run on (service.autolayout.cluster_for_job).
The answer is the planner's JSON (parallel.planner.report), plus where the cluster came from
and, for `parallelism: auto`, the layout a submission would store.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from starlette.concurrency import run_in_threadpool

from api import schemas
from api.deps import ApiError, Caller, State
from api.routers.jobs import ERRORS, SUBMIT_OPENAPI, _parse_body
from service.submission import parse_job_spec

router = APIRouter(prefix="/v1", tags=["plan"])

Preset = Literal["h100", "h200", "a100", "cpu"]


def _plan(spec: Any, total: dict[str, float] | None, gpus: int | None, gpu: str | None,
          nodes: int | None) -> dict[str, Any]:
    from parallel.planner.report import plan_from_spec
    from service.autolayout import LayoutRefused, cluster_for_job, resolve_auto

    try:
        jc = cluster_for_job(spec, total, gpus=gpus, gpu=gpu, nodes=nodes)
    except LayoutRefused as e:
        lines = "; ".join(f"{f}: {m}" for f, m in e.problems)
        raise ApiError(422, "validation_failed", f"no cluster to plan for: {lines}", e.problems) from e
    c = jc.cluster
    out = plan_from_spec(spec, c.world, c.hardware.name, c.nodes)
    out["cluster"]["source"] = jc.source
    if spec.parallelism.auto:
        # What POST /v1/jobs would store: the best layout the job's dp range also allows.
        try:
            auto = resolve_auto(spec, jc, total if gpus is None else None)
            out["submission"] = {"ok": True, "layout": auto.candidate.layout.label(), **auto.event_data()}
        except LayoutRefused as e:
            out["submission"] = {"ok": False, "reasons": [m for _, m in e.problems]}
    return out


@router.post(
    "/plan",
    openapi_extra=SUBMIT_OPENAPI,
    response_model=dict[str, Any],
    responses={**ERRORS, 413: {"model": schemas.ErrorBody, "description": "body too large"}},
    summary="Plan a job's parallel layout on a cluster (nothing is stored)",
)
async def plan_job(
    request: Request,
    _caller: Caller,
    state: State,
    gpus: Annotated[int | None, Query(ge=1, le=65536, description="devices in all (default: the cluster's)")] = None,
    gpu: Annotated[Preset | None, Query(description="hardware preset (default: the cluster's)")] = None,
    nodes: Annotated[int | None, Query(ge=1, le=1 << 16, description="nodes (default: as few full nodes as fit)")] = None,
) -> dict[str, Any]:
    """`ok` false (still 200) when no layout fits; `reasons` say why. Store-only servers without a
    cluster view need ?gpus=."""
    raw = await request.body()
    spec = parse_job_spec(_parse_body(raw, request.headers.get("content-type", "")))
    total = await run_in_threadpool(state.cluster_view)
    return await run_in_threadpool(_plan, spec, total, gpus, gpu, nodes)
