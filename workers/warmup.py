"""Getting a worker ready before it joins a group: the engine imported, the job's data opened, its model
traced and one step taken alone, so that a spare or a replacement only forms the group, shards and
restores when its generation starts. The CPU-heavy parts run at a low priority (workers.low_priority),
so that a worker starting beside training ranks does not slow them."""

from __future__ import annotations

import gc
import os
from typing import Any

from parallel.layout_rules import engine_at_dp
from workers.low_priority import at_low_priority

# A worker warms up with one step of the whole model (warm_step) up to this many parameters.
WARM_STEP_MAX_PARAMS = 50_000_000


def import_engine() -> None:
    """torch and the engine imported (about 2 CPU-s, torch._dynamo included), at a low priority."""
    at_low_priority(_import_engine, "import")


def _import_engine() -> None:
    import torch

    import checkpointing.peer_heal  # noqa: F401
    import checkpointing.persistent  # noqa: F401
    import checkpointing.snapshot  # noqa: F401  (the tiers' and the restore's: ~25 ms, in every new rank)
    import parallel.trainer  # noqa: F401

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # A model's first parameter init imports torch._dynamo (torch._refs' normal_ is wrapped by it): 0.35-0.55
    # CPU-s that each worker forked from a zygote would pay again in its warm-up, beside training ranks.
    torch.empty(1, device="meta").normal_()


def warm_up(cfg: Any, device: Any) -> dict[str, Any]:
    """Open the job's data (tokenized once per process, cached: parallel.data.corpus), build the model on
    the meta device (its code imported and traced once) and take one step alone where the layout allows.
    A problem is left to the start-up probe and the generation's own build to report with their reasons;
    the answer says what happened. On CUDA the warm step starts autograd's device thread, which every later
    backward runs on: that thread must not be born at a low priority, so only the CPU path lowers it."""
    if device.type == "cuda":
        return _warm_up(cfg, device)
    return at_low_priority(lambda: _warm_up(cfg, device), "warm")


def _warm_up(cfg: Any, device: Any) -> dict[str, Any]:
    warmed: dict[str, Any] = {}
    try:
        from parallel.data import DataLoader
        from parallel.model import build_model

        t = cfg.training
        DataLoader(cfg.data, t.seq_len, t.global_batch_size, cfg.model.vocab_size, t.micro_batch_size)
        model = build_model(cfg.model, device="meta")
        params = sum(p.numel() for p in model.parameters())
        warmed["step"] = warm_step(cfg, device) if params <= WARM_STEP_MAX_PARAMS else False
    except Exception as e:  # noqa: BLE001 - reported by the probe and the build, where it matters
        warmed["error"] = f"{type(e).__name__}: {e}"[:500]
    return warmed


def warm_step(cfg: Any, device: Any) -> bool:
    """One training step of the job's model alone (world 1, one sequence, then thrown away): the
    process's first forward, backward and optimizer step (autograd's threads, the kernels' first
    calls) are paid here rather than in the first step after it joins a group. Only for a layout
    without model parallelism (one rank holds the whole model) and a model small enough to hold."""
    import torch.distributed as dist

    p = cfg.parallelism
    if dist.is_initialized() or p.tp * p.pp * p.cp * p.ep != 1:
        return False
    if cfg.training.compile or cfg.model.init_from:  # minutes of compiling / a checkpoint read
        return False
    from parallel.trainer import Trainer

    solo = engine_at_dp(cfg, 1)
    solo.training = solo.training.model_copy(update={"global_batch_size": 1, "micro_batch_size": None,
                                                     "eval_every": None})
    solo.data = solo.data.model_copy(update={"eval": None})
    Trainer(solo, device=device).train_step()
    return True


def open_checkpoint_store(ckpt_cfg: Any, root: str) -> str | None:
    """Open the job's checkpoint store once, at a low priority. A process's first S3 client costs about
    0.28 s of CPU (boto3's import, botocore's service models); a worker that joins a generation later (a
    replacement, a spare, a grow-back) paid it in its tiers, after the rendezvous and before the restore,
    while every other rank waited for it in the restore's agreement. The client is kept per process and
    settings (checkpointing.storage_s3), so the generation's CheckpointManager gets this one. Returns why
    the store could not be opened (the start-up probe and the tiers report it where it matters), else None."""

    def body() -> None:
        from checkpointing.uri import open_store

        open_store(root, ckpt_cfg.s3)

    try:
        at_low_priority(body, "store")
    except Exception as e:  # noqa: BLE001 - said by the probe and the tiers, with their context
        return f"{type(e).__name__}: {e}"[:500]
    return None


def freeze_heap() -> None:
    """Collect, then move every object alive now (the imported engine, Ray, torch: ~300k) out of the
    collector's sight: the full collection after a failed generation (the worker's `run`) then scans only
    what came since, ~0.05 s instead of ~1 s on 2 loaded cores, with the same garbage found."""
    gc.collect()
    gc.freeze()
