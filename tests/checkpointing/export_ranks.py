"""Rank bodies for test_export_checkpoint (run by tests.parallel.harness in real gloo groups).

Each layout trains the tiny model and writes persistent checkpoints at steps 2 and 3, the way a
worker does (a CheckpointManager given `config=trainer.cfg.model_dump(mode="json")`, then `save_async`);
rank 0 returns `Trainer.full_state_dict()` at each saved step: what export must reproduce.
"""

from __future__ import annotations

from typing import Any

import torch

from checkpointing.config import CheckpointConfig, S3Config
from checkpointing.persistent import CheckpointManager
from parallel.config import EngineConfig
from parallel.trainer import Trainer

SAVED_STEPS = (2, 3)


def engine_cfg(model: dict[str, Any], parallelism: dict[str, Any]) -> EngineConfig:
    return EngineConfig.model_validate({
        "model": model,
        "training": {"steps": max(SAVED_STEPS), "seq_len": 16, "global_batch_size": 4, "warmup_steps": 1,
                     "lr": 1e-2},
        "parallelism": parallelism,
    })  # fmt: skip


def save_layouts(ctx: Any, payload: dict[str, Any]) -> dict[str, dict[int, dict[str, torch.Tensor]]]:
    out: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for lay in payload["layouts"]:

        def body(lay: dict[str, Any] = lay) -> dict[int, dict[str, torch.Tensor]]:
            cfg = engine_cfg(lay["model"], lay["parallelism"])
            trainer = Trainer(cfg, device=torch.device("cpu"))
            s3 = S3Config(**lay["s3"]) if lay.get("s3") else S3Config()
            mgr = CheckpointManager(CheckpointConfig(uri=lay["uri"], s3=s3, keep_last=5), "unused",
                                    rank=ctx.rank, world_size=lay["world"],
                                    config=trainer.cfg.model_dump(mode="json"))  # fmt: skip
            fulls: dict[int, dict[str, torch.Tensor]] = {}
            for step in SAVED_STEPS:
                while trainer.step < step:
                    trainer.train_step()
                res = mgr.save_async(
                    trainer.state_dict(), trainer.step, 0, {"dp": trainer.dims.dp, "world_size": lay["world"]}
                ).result()
                assert res.ok, res.error
                fulls[step] = trainer.full_state_dict()  # a collective: every rank takes part
            mgr.close()
            return fulls if ctx.rank == 0 else {}

        result = ctx.in_group(lay["world"], lay["name"], body)
        if result is not None:
            out[lay["name"]] = result
    return out
