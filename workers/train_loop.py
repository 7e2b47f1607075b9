"""The one train loop, shared by the local launcher's ranks (workers.rank_main) and the Ray worker
(workers.worker): steps until the last one (or until a hook stops it), then the final state.

The callers differ only in what happens around a step (fault injection, chaos, heartbeats,
snapshots, a pause to grow), which they pass in as `LoopHooks`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.protocol import RunStatus


class LoopHooks:
    """What a caller does around the steps; every hook is optional (the defaults do nothing)."""

    def stop_before_step(self) -> RunStatus | None:
        """A status to end with now, before the next step (e.g. ABORTED)."""
        return None

    def before_step(self, done: int) -> None:
        """Just before the step after `done` steps runs; may raise or stall (fault injection)."""

    def after_step(self, metrics: Any, gap_s: float) -> RunStatus | None:
        """After a step (`gap_s`: the time spent outside the step since the last one); a status to end
        with now (e.g. PAUSED)."""
        return None

    def before_final(self) -> None:
        """Every step done: before the final state is gathered (e.g. wait for checkpoints in flight)."""


@dataclass
class LoopEnd:
    status: RunStatus
    step: int
    final: str | None = None  # rank 0 of a finished run: where the final state went


def train(trainer: Any, cfg: Any, rank: int, output_dir: str | Path, hooks: LoopHooks) -> LoopEnd:
    """Train `trainer` to cfg.training.steps; rank 0 writes the final state into <output_dir>/final."""
    steps = cfg.training.steps
    while trainer.step < steps:
        stop = hooks.stop_before_step()
        if stop is not None:
            return LoopEnd(stop, trainer.step)
        t_prev = time.time()
        hooks.before_step(trainer.step)
        entered = time.time()
        m = trainer.train_step()
        stop = hooks.after_step(m, entered - t_prev)
        if stop is not None:
            return LoopEnd(stop, trainer.step)
    hooks.before_final()
    state = trainer.full_state_dict()  # a collective: every rank takes part
    final = None
    if rank == 0:
        from workers.final_state import FINAL_DIR, save_final_state

        final = str(save_final_state(state, cfg, Path(output_dir) / FINAL_DIR))
    return LoopEnd(RunStatus.FINISHED, trainer.step, final)
