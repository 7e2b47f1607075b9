"""goodput_bench's Ray Train side: the training loop its TorchTrainer runs on each of its workers.

Also recovery_bench's (our Trainer on the group Ray Train formed, a DCP checkpoint reported every step).
With a deadline: where Ray Train cannot finish the faulty job in the time the bench gives it, the ranks
agree to stop at a step boundary (a MAX all-reduce of "past the deadline", so none waits in a collective
the others left) and fit() returns; the bench then measures the progress made in that time.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def train_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker: our Trainer on the group Ray Train formed, a DCP checkpoint every step.
    Optional keys: `pid_dir` (where an outside fault injector finds this attempt's ranks), `deadline`
    (stop together at a step boundary past it), `kill_after` + `marker` (rank 1 exits once, after that
    many steps: recovery_bench's kill)."""
    import ray.train
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from parallel.config import EngineConfig
    from parallel.trainer import Trainer

    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()
    if config.get("pid_dir"):
        Path(config["pid_dir"], str(rank)).write_text(str(os.getpid()))
    cfg = EngineConfig.model_validate(config["engine"])
    trainer = Trainer(cfg, device=torch.device("cpu"))
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = trainer.state_dict()
            dcp.load(state, checkpoint_id=d)
            trainer.load_state_dict(state)
    log = Path(config["log"])
    deadline = config.get("deadline")
    marker = Path(config.get("marker") or "/nonexistent/none")
    while trainer.step < cfg.training.steps:
        if deadline is not None:  # far off for a fault-free run: the same check every step
            past = torch.tensor([1.0 if time.time() > float(deadline) else 0.0])
            dist.all_reduce(past, op=dist.ReduceOp.MAX)
            if past.item() > 0:
                if rank == 0:
                    with log.open("a") as f:
                        f.write(json.dumps({"stopped": time.time(), "step": trainer.step}) + "\n")
                return
        if rank == 1 and config.get("kill_after") == trainer.step and not marker.exists():
            marker.write_text(str(time.time()))
            os._exit(1)
        m = trainer.train_step()
        d = Path(config["ckpt_root"]) / f"step-{trainer.step}"
        dcp.save(trainer.state_dict(), checkpoint_id=str(d))
        ray.train.report({"step": trainer.step, "loss": m.loss},
                         checkpoint=ray.train.Checkpoint.from_directory(str(d)) if rank == 0 else None)
        if rank == 0:  # after the report: a step counts once its checkpoint is registered
            with log.open("a") as f:
                f.write(json.dumps({"step": trainer.step, "time": time.time(), "loss": m.loss}) + "\n")
