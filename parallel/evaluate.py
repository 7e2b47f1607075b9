"""Held-out evaluation: the mean loss on a fixed set, identical whatever the dp degree or layout.

The eval set (parallel.data.loader: `data.eval`) is cut into batches of global_batch_size windows
and sliced over dp ranks as training batches are; each rank sums its token losses in a forward
pass (the pipeline schedule's forward-only pass under pp), the sums are added over dp x cp, and
the total is divided by the eval set's count of loss-bearing tokens, which every rank knows from
the data. It runs inside `Trainer.train_step` after the step's own metrics are taken, so its
results reach every place a step's metrics go (metrics.jsonl, the API, TensorBoard, Prometheus).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from parallel.config import EngineConfig
from parallel.loss import token_loss_sum

if TYPE_CHECKING:
    from parallel.trainer import Trainer


def eval_due(step: int, cfg: EngineConfig) -> bool:
    """Evaluate after `step` (1-based, just completed): every training.eval_every steps, and after the last."""
    if cfg.data.eval is None:
        return False
    every = cfg.training.eval_every
    return step == cfg.training.steps or (every is not None and step % every == 0)


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


@torch.no_grad()
def evaluate(trainer: Trainer) -> tuple[float, float]:
    """(eval loss, seconds taken). A collective: every rank of the job calls it at the same step."""
    t0 = time.perf_counter()
    model = trainer.model
    model.eval()
    total = torch.zeros((), dtype=torch.float32, device=trainer.device)
    batches = trainer.data.eval_batches(trainer.dp_rank, trainer.dims.dp)
    try:
        if trainer.pipeline is not None:
            scale, trainer._grad_scale = trainer._grad_scale, 1.0  # the stage loss function's factor
            try:
                for micro in batches:
                    total += trainer.pipeline_run(micro, train=False)
            finally:
                trainer._grad_scale = scale
        else:
            for micro in batches:
                for batch in micro:
                    with trainer.micro_batch(batch) as (inputs, targets, kwargs):
                        with trainer._autocast():
                            logits = model(inputs, **kwargs)
                        total += token_loss_sum(logits, targets)
    finally:
        model.train()
    if trainer.mesh is not None and trainer.dims.dp_cp > 1:
        dist.all_reduce(total, group=trainer.dims.get_mesh(trainer.mesh, "dp_cp").get_group())
    trainer._sync()
    return float(total) / max(trainer.data.eval_tokens(), 1), time.perf_counter() - t0
