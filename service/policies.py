"""Small policy objects the supervisor consults: failures, scaling, stragglers.

Pure logic (no Ray), so each rule is tested on its own and the supervisor stays a loop of
"observe, ask the policy, act". The supervisor gets them passed in (`Policies`), so another rule is
another object, not an edit of the supervisor.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple


class FailureKind(StrEnum):
    """What the supervisor can observe going wrong."""

    WORKER_DIED = "worker_died"            # ActorDiedError from a worker, or its process gone
    NODE_DIED = "node_died"                # the worker's node is dead in Ray's view
    HANG = "hang"                          # no heartbeat for heartbeat_timeout_s
    COLLECTIVE_ERROR = "collective_error"  # a worker's collective failed (a peer went away, a timeout)
    STEP_ERROR = "step_error"              # an exception in the training step
    STRAGGLER = "straggler"                # replaced because it was too slow
    BUILD_ERROR = "build_error"            # the engine could not be built (config, weights): no retry helps


FAILURE_KINDS = tuple(k.value for k in FailureKind)


class FailureDecision(NamedTuple):
    """Whether to recover from a failure, and when not, why (a sentence for the job's reason)."""

    recover: bool
    reason: str = ""


@dataclass
class FailurePolicy:
    max_recoveries: int
    fatal_kinds: frozenset[str] = frozenset({FailureKind.BUILD_ERROR})
    # The same rank failing in its step at the same step this often is a bug in the job, not a fault.
    max_same_step_errors: int = 3
    _step_errors: dict[int, int] = field(default_factory=dict)

    def decide(self, kind: str, recoveries_done: int, step: int | None = None) -> FailureDecision:
        if kind in self.fatal_kinds:
            return FailureDecision(False, f"a {kind} is not recoverable")
        if kind == FailureKind.STEP_ERROR and step is not None:
            self._step_errors[step] = self._step_errors.get(step, 0) + 1
            if self._step_errors[step] >= self.max_same_step_errors:
                return FailureDecision(
                    False, f"step {step + 1} failed {self._step_errors[step]} times: the error is in the job")
        if recoveries_done >= self.max_recoveries:
            return FailureDecision(False, (
                f"max_recoveries={self.max_recoveries} reached; raise fault_tolerance.max_recoveries to allow more"
            ))
        return FailureDecision(True)


@dataclass
class ScalingPolicy:
    """The data-parallel degree from whole replicas available, within dp.min..dp.max."""

    dp_min: int
    dp_max: int
    # Ready replicas wait this long at most for others still starting, to grow once with all of them: a
    # growth's pause costs about a second, a worker's start on a busy node can take ten.
    grow_wait_s: float = 2.0

    def choose(self, live_replicas: int, startable_replicas: int = 0) -> int | None:
        """The largest dp the live plus startable replicas allow, capped at dp_max; None below dp_min."""
        n = min(self.dp_max, live_replicas + startable_replicas)
        return n if n >= self.dp_min else None

    def wants_growth(self, dp: int, spare_replicas: int) -> int:
        """How many spare replicas to add now (0 when at max or none are ready)."""
        return max(0, min(self.dp_max - dp, spare_replicas))

    def grow_now(self, starting: int, ready_for_s: float) -> bool:
        """Whether to grow with the ready replicas now (the first of them ready for `ready_for_s`) rather
        than wait for the `starting` ones and grow once."""
        return starting == 0 or ready_for_s >= self.grow_wait_s


@dataclass
class StragglerPolicy:
    """A rank whose own time per step keeps exceeding factor x the median rank's is a straggler.

    In lockstep every rank's step *time* is about the same: fast ranks wait inside collectives
    for the slow one. A rank's own time is what it spends outside the step before entering it
    (`gap_s`: data, injected delays, a slow host) plus the shortest step time of the step (the
    rank that waited least). Slow `patience` steps in a row -> reported once.
    """

    factor: float
    action: str = "warn"  # or "replace": see `replaces`
    patience: int = 3
    _late: dict[str, int] = field(default_factory=dict)

    def observe(self, gaps: dict[str, float], step_times: dict[str, float]) -> list[str]:
        """One step's gaps and step times by worker; returns the workers that became stragglers."""
        if len(gaps) < 3 or not step_times:
            return []
        base = min(step_times.values())
        own = {w: g + base for w, g in gaps.items()}
        med = statistics.median(own.values())
        slow = []
        for w, t in own.items():
            if t > self.factor * med:
                self._late[w] = self._late.get(w, 0) + 1
                if self._late[w] == self.patience:
                    slow.append(w)
            else:
                self._late.pop(w, None)
        return slow

    @property
    def replaces(self) -> bool:
        """Whether a straggler is replaced (a failure of kind STRAGGLER) rather than only reported."""
        return self.action == "replace"

    def reset(self) -> None:
        self._late.clear()


@dataclass
class Policies:
    """The rules a supervisor follows, passed to it whole."""

    failures: FailurePolicy
    scaling: ScalingPolicy
    stragglers: StragglerPolicy
