"""The planner as JSON, for `POST /v1/plan` and `unbroken plan --json`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from parallel.config import EngineConfig
from parallel.planner.hardware import PlanError, make_cluster
from parallel.planner.search import Candidate, PlanResult, plan


def result_to_dict(result: PlanResult, *, top: int | None = None, max_rejected: int | None = None) -> dict[str, Any]:
    best = result.best
    cluster = result.cluster
    req = result.requested
    return {
        "ok": best is not None,
        "cluster": {"gpu": cluster.hardware.name, "gpus": cluster.world, "nodes": cluster.nodes,
                    "gpus_per_node": cluster.devices_per_node, "device_memory_bytes": cluster.device_mem_bytes},
        "errors": result.errors,
        "fixed": result.fixed,
        "best": best.to_dict() if best else None,
        "parallelism": best.layout.to_dict() if best else None,
        "candidates": [c.to_dict() for c in result.candidates[:top]],
        "rejected": [r.to_dict() for r in result.rejected[:max_rejected]],
        "requested": None if req is None else {"fits": isinstance(req, Candidate), **req.to_dict()},
        "reasons": [] if best else result.reasons(),
    }


def plan_from_spec(spec: EngineConfig, gpus: int, gpu: str = "h100", nodes: int | None = None, *,
                   top: int | None = 10, max_rejected: int | None = 50,
                   allowed_dims: Iterable[str] | None = None, activation_model: str = "engine") -> dict[str, Any]:
    """Plan a job (an EngineConfig or JobSpec) on `gpus` devices of preset `gpu` over `nodes` nodes.

    Never raises for an impossible request: `ok` is false and `errors`/`reasons` say why."""
    try:
        cluster = make_cluster(gpus, gpu, nodes)
    except PlanError as e:
        return {"ok": False, "cluster": {"gpu": gpu, "gpus": gpus, "nodes": nodes}, "errors": e.reasons,
                "fixed": {}, "best": None, "parallelism": None, "candidates": [], "rejected": [],
                "requested": None, "reasons": e.reasons}
    result = plan(spec, cluster, allowed_dims=allowed_dims, activation_model=activation_model)
    return result_to_dict(result, top=top, max_rejected=max_rejected)
