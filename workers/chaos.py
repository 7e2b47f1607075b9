"""Fault injection inside a worker, from a job's `chaos` list (like torchft's fail_at(rank, step)).

An event fires in the training loop of the worker that holds `rank` in `generation`, when that
worker has completed `step` steps (step 0: before the first step), so it fires once:

- kill_worker: os._exit(1)                 - sigkill_worker: SIGKILL itself
- hang_worker: SIGSTOP itself (the train loop and the heartbeat thread both stop; only missed
  heartbeats can tell)
- kill_node: SIGKILL this node's raylet (the worker's parent); refused on the head node
- slow_worker: sleep `seconds` before every step from then on (a straggler)
- raise_in_step: raise ChaosError inside the step
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

KINDS = ("kill_worker", "sigkill_worker", "hang_worker", "kill_node", "slow_worker", "raise_in_step")


class ChaosError(RuntimeError):
    """An injected failure (raise_in_step), or a chaos event that cannot fire here."""


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int = 0
    seconds: float = 5.0
    generation: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Fault:
        if d.get("kind") not in KINDS:
            raise ValueError(f"chaos kind {d.get('kind')!r} is not one of {KINDS}")
        return cls(str(d["kind"]), int(d["step"]), int(d.get("rank", 0)), float(d.get("seconds", 5.0)),
                   int(d.get("generation", 0)))


class Chaos:
    """The faults meant for one worker; `before_step` is called before each training step."""

    def __init__(
        self,
        faults: list[dict[str, Any]] | list[Fault],
        *,
        is_head_node: Callable[[], bool],
        on_fire: Callable[[Fault], None] | None = None,
    ) -> None:
        self.faults = [f if isinstance(f, Fault) else Fault.from_dict(f) for f in faults]
        self._is_head_node = is_head_node
        self._on_fire = on_fire
        self._fired: set[Fault] = set()
        self.slow_s = 0.0

    def before_step(self, completed_steps: int, rank: int, generation: int) -> None:
        for f in self.faults:
            if f in self._fired or (f.rank, f.step, f.generation) != (rank, completed_steps, generation):
                continue
            self._fired.add(f)
            self._fire(f)
        if self.slow_s:
            time.sleep(self.slow_s)

    def _fire(self, f: Fault) -> None:
        if f.kind == "slow_worker":
            self.slow_s = f.seconds
        if self._on_fire is not None:
            self._on_fire(f)  # a note (log line, fault time) before the process may vanish
        if f.kind == "kill_worker":
            os._exit(1)
        elif f.kind == "sigkill_worker":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.kind == "hang_worker":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif f.kind == "kill_node":
            if self._is_head_node():
                raise ChaosError("chaos kill_node: this worker runs on the head node; pick a rank on another node")
            os.kill(os.getppid(), signal.SIGKILL)  # the raylet: the node's workers go with it
            time.sleep(60)  # this process is about to be reaped with its node
        elif f.kind == "raise_in_step":
            raise ChaosError(f"injected fault (chaos raise_in_step) at step {f.step} on rank {f.rank}")
