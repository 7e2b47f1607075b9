"""Rank bodies for the data tests' multi-rank runs (started by tests.parallel.harness)."""

from __future__ import annotations

from typing import Any

import torch

from parallel.trainer import Trainer
from tests.parallel.rank_fns import make_cfg


def train_layouts(ctx: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """Each (base, layouts) run: every layout trains `steps` steps; rank 0 returns per layout the
    train losses, the eval losses by step, and the final full weights."""
    out: dict[str, Any] = {}
    for run in payload["runs"]:
        for lay in run["layouts"]:
            def body(lay: dict[str, Any] = lay, base: dict[str, Any] = run["base"]) -> dict[str, Any]:
                cfg = make_cfg(base, lay.get("parallelism"), lay.get("training"), lay.get("model"))
                trainer = Trainer(cfg, device=torch.device("cpu"))
                metrics = [trainer.train_step() for _ in range(cfg.training.steps)]
                full = trainer.full_state_dict()
                return {"losses": [m.loss for m in metrics],
                        "eval": {m.step: m.eval_loss for m in metrics if getattr(m, "eval_loss", None) is not None},
                        "weights": full if ctx.rank == 0 else None}
            result = ctx.in_group(lay["world"], lay["name"], body)
            if result is not None:
                out[lay["name"]] = result
    return out


def elastic_with_eval(ctx: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """Train through segments of different dp sizes (each resumes from the previous segment's DCP
    checkpoint, written at another world size); returns train losses and eval losses by step."""
    import torch.distributed.checkpoint as dcp

    losses: list[float] = []
    evals: dict[int, float] = {}
    prev: str | None = None
    for k, (world, until) in enumerate(payload["segments"]):
        path = f"{payload['dir']}/seg{k}"

        def body(until: int = until, prev: str | None = prev, path: str = path) -> tuple[list[Any], dict[int, float]]:
            cfg = make_cfg(payload["base"])
            trainer = Trainer(cfg, device=torch.device("cpu"))
            if prev is not None:
                state = trainer.state_dict()
                dcp.load(state, checkpoint_id=prev)
                trainer.load_state_dict(state)
            seg = []
            while trainer.step < until:
                seg.append(trainer.train_step())
            dcp.save(trainer.state_dict(), checkpoint_id=path)
            return [m.loss for m in seg], {m.step: m.eval_loss for m in seg if m.eval_loss is not None}

        got = ctx.in_group(world, f"elastic-eval{k}", body)
        ctx.barrier(f"elastic-eval{k}")
        if got is not None:
            losses.extend(got[0])
            evals.update(got[1])
        prev = path
    return {"losses": losses, "eval": evals}
