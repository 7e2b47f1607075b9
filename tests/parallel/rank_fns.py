"""Per-rank bodies for the multi-process parity tests (run by tests.parallel.harness)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from parallel.config import EngineConfig
from parallel.regroup import _fsdp_groups
from parallel.trainer import Trainer


def make_cfg(base: dict[str, Any], parallelism: dict[str, Any] | None = None,
             training: dict[str, Any] | None = None, model: dict[str, Any] | None = None) -> EngineConfig:
    raw = copy.deepcopy(base)
    raw.setdefault("model", {}).update(model or {})
    raw.setdefault("parallelism", {}).update(parallelism or {})
    raw.setdefault("training", {}).update(training or {})
    return EngineConfig.model_validate(raw)


def run_steps(trainer: Trainer, until: int) -> list[float]:
    losses = []
    while trainer.step < until:
        losses.append(trainer.train_step().loss)
    return losses


def parity_layouts(ctx: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """Run each layout for `steps` steps; rank 0 returns losses and final full weights per layout."""
    out: dict[str, Any] = {}
    for lay in payload["layouts"]:
        def body(lay: dict[str, Any] = lay) -> dict[str, Any]:
            cfg = make_cfg(payload["base"], lay.get("parallelism"), lay.get("training"), lay.get("model"))
            trainer = Trainer(cfg, device=torch.device("cpu"))
            init = trainer.full_state_dict() if lay.get("check_init") else None
            metrics = [trainer.train_step() for _ in range(cfg.training.steps)]
            full = trainer.full_state_dict()
            return {"losses": [m.loss for m in metrics], "grad_norms": [m.grad_norm for m in metrics],
                    "weights": full if ctx.rank == 0 else None, "init": init if ctx.rank == 0 else None,
                    "fsdp_units": len(_fsdp_groups(trainer.model))}
        result = ctx.in_group(lay["world"], lay["name"], body)
        if result is not None:
            out[lay["name"]] = result
    return out


def elastic_segments(ctx: Any, payload: dict[str, Any]) -> list[float]:
    """Train through segments of different dp sizes, handing the state over by a DCP save and load."""
    import torch.distributed.checkpoint as dcp

    losses: list[float] = []
    prev: str | None = None
    for k, (world, until) in enumerate(payload["segments"]):
        path = f"{payload['dir']}/seg{k}"

        def body(world: int = world, until: int = until, prev: str | None = prev, path: str = path) -> list[float]:
            cfg = make_cfg(payload["base"], payload.get("parallelism"), payload.get("training"))
            trainer = Trainer(cfg, device=torch.device("cpu"))
            if prev is not None:
                state = trainer.state_dict()
                dcp.load(state, checkpoint_id=prev)
                trainer.load_state_dict(state)
            seg = run_steps(trainer, until)
            dcp.save(trainer.state_dict(), checkpoint_id=path)
            return seg

        seg = ctx.in_group(world, f"elastic{k}", body)
        ctx.barrier(f"elastic{k}")
        if seg is not None:
            losses.extend(seg)
        elif ctx.rank == 0:
            raise AssertionError("rank 0 takes part in every segment")
        prev = path
    return losses


def parity_and_elastic(ctx: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """Both checks in one launch: process start-up dominates on a small machine."""
    return {"parity": parity_layouts(ctx, payload), "elastic": elastic_segments(ctx, payload["elastic"])}


def bench_layouts(ctx: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """Per layout: every step's tokens/s and the peak memory (rank 0's view)."""
    out: dict[str, Any] = {}
    for lay in payload["layouts"]:
        def body(lay: dict[str, Any] = lay) -> dict[str, Any]:
            cfg = make_cfg(payload["base"], lay.get("parallelism"), lay.get("training"), lay.get("model"))
            trainer = Trainer(cfg, device=torch.device("cpu"))
            metrics = [trainer.train_step() for _ in range(cfg.training.steps)]
            return {"tokens_per_s": [m.tokens_per_s for m in metrics], "peak_mem": metrics[-1].peak_mem_bytes}
        result = ctx.in_group(lay["world"], lay["name"], body)
        if result is not None:
            out[lay["name"]] = result
    return out

