"""Liveness (/healthz: the process answers) and readiness (/readyz: the store and Ray answer)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from sqlalchemy import text

from api import schemas
from api.deps import AppState, get_state

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=schemas.Health, summary="The server process is up")
def healthz() -> schemas.Health:
    return schemas.Health(status="ok")


@router.get(
    "/readyz", response_model=schemas.Health,
    responses={503: {"model": schemas.Health, "description": "the store or the Ray cluster does not answer"}},
    summary="The job store (and the Ray cluster, when scheduling) answer",
)
def readyz(state: AppState = Depends(get_state)) -> JSONResponse:
    detail: dict[str, object] = {"store": state.store.engine.dialect.name, "scheduler": state.scheduler is not None}
    ok = True
    try:
        with state.store.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as e:
        ok = False
        detail["store_error"] = f"{type(e).__name__}: {e}"[:300]
    if state.scheduler is not None:
        total = state.scheduler.cluster_total()
        if total is None:
            ok = False
            detail["ray_error"] = "the Ray cluster does not answer"
        else:
            detail["cluster"] = {k: v for k, v in total.items() if k in ("CPU", "GPU")}
    body = schemas.Health(status="ok" if ok else "unavailable", detail=detail)
    return JSONResponse(body.model_dump(mode="json"), status_code=200 if ok else 503)
