"""The supervisor's job states and the transitions allowed between them.

    STARTING -> RUNNING <-> RECOVERING, RUNNING <-> RESIZING, RUNNING -> FINISHING -> SUCCEEDED
    any live state -> FAILED | CANCELLED

A transition that is not in the table raises IllegalTransition: a bug in the supervisor shows at
once instead of as a job in an impossible state. `store_status` maps a state to the job store's
coarser statuses (service/statuses.py: PENDING, RUNNING, RECOVERING, SUCCEEDED, FAILED, CANCELLED).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import StrEnum

from service import statuses


class JobState(StrEnum):
    STARTING = "STARTING"
    RUNNING = statuses.RUNNING
    RECOVERING = statuses.RECOVERING
    RESIZING = "RESIZING"
    FINISHING = "FINISHING"
    SUCCEEDED = statuses.SUCCEEDED
    FAILED = statuses.FAILED
    CANCELLED = statuses.CANCELLED


TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
_END = {JobState.FAILED, JobState.CANCELLED}
ALLOWED: dict[JobState, frozenset[JobState]] = {
    JobState.STARTING: frozenset({JobState.RUNNING, JobState.RECOVERING, *_END}),
    JobState.RUNNING: frozenset({JobState.RECOVERING, JobState.RESIZING, JobState.FINISHING, *_END}),
    JobState.RECOVERING: frozenset({JobState.RUNNING, JobState.RECOVERING, *_END}),
    JobState.RESIZING: frozenset({JobState.RUNNING, JobState.RECOVERING, *_END}),
    JobState.FINISHING: frozenset({JobState.SUCCEEDED, JobState.RECOVERING, *_END}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}

# The job store's statuses: a resize or the last collective is still "running" to a user.
STORE_STATUS: dict[JobState, str] = {
    JobState.STARTING: statuses.RUNNING,
    JobState.RUNNING: statuses.RUNNING,
    JobState.RECOVERING: statuses.RECOVERING,
    JobState.RESIZING: statuses.RUNNING,
    JobState.FINISHING: statuses.RUNNING,
    JobState.SUCCEEDED: statuses.SUCCEEDED,
    JobState.FAILED: statuses.FAILED,
    JobState.CANCELLED: statuses.CANCELLED,
}


class IllegalTransition(RuntimeError):
    pass


@dataclass
class Transition:
    time: float
    source: JobState
    target: JobState
    reason: str


@dataclass
class StateMachine:
    state: JobState = JobState.STARTING
    history: list[Transition] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def can(self, target: JobState) -> bool:
        return target in ALLOWED[self.state]

    def to(self, target: JobState, reason: str = "") -> Transition:
        with self._lock:
            if target not in ALLOWED[self.state]:
                raise IllegalTransition(f"job state {self.state.value} -> {target.value} is not allowed ({reason})")
            t = Transition(time.time(), self.state, target, reason)
            self.state = target
            self.history.append(t)
            return t
