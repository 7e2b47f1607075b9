"""A job's goodput so far: how much of its wall time since its first step went into steps.

From what the store already holds: the metrics rows (one a step, with its `end_time` and `step_time_s`)
and the pauses the supervisor measured at each re-form (`recovered` and `resumed` events' `pause_s`, by
service.supervisor.pauses' rule). The wall time runs from the first step's start to the last step's
end, so a job's start-up and queueing are not in it; what is neither a step nor a re-form's pause (data
waits, evaluation, a checkpoint's wait) is `other_s`. No fault-free baseline is known here, so steps
made slower by a fault count as steps: goodput_bench's ETTR is the stricter figure.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from service.text import plural

# The events that carry a re-form's pause, and where each names its cause.
PAUSE_EVENTS = {"recovered": "kind", "resumed": "cause"}
_PAGE = 10000


@dataclass
class Goodput:
    steps: int = 0  # steps with a row
    wall_s: float = 0.0  # first step's start -> last step's end
    step_s: float = 0.0  # the steps' own time
    paused_s: float = 0.0  # the re-forms' pauses
    pauses: int = 0
    lost_steps: int = 0  # steps trained again after recoveries
    by_cause: dict[str, float] = field(default_factory=dict)  # seconds paused, by cause

    @property
    def other_s(self) -> float:
        return max(0.0, self.wall_s - self.step_s - self.paused_s)

    @property
    def ratio(self) -> float | None:
        """The share of the wall time spent in steps; None before a step with times."""
        return min(1.0, self.step_s / self.wall_s) if self.wall_s > 0 else None

    def summary(self) -> str:
        """One line for people (the CLI, the console, the demo): the one place it is worded, e.g.
        "0.93 of 81.2s since step 1 in steps; paused 4.1s in 6 re-forms (worker_died 2.9s, growth 1.2s);
        1 step trained again". "-" before a timed step."""
        if self.ratio is None:
            return "-"
        out = f"{self.ratio:.2f} of {self.wall_s:.1f}s since step 1 in steps"
        if self.pauses:
            causes = ", ".join(f"{k} {v:.1f}s" for k, v in sorted(self.by_cause.items(), key=lambda kv: -kv[1]))
            out += f"; paused {self.paused_s:.1f}s in {plural(self.pauses, 're-form')} ({causes})"
        if self.lost_steps:
            out += f"; {plural(self.lost_steps, 'step')} trained again"
        return out


def goodput_of(rows: Iterable[dict[str, Any]], events: Iterable[tuple[str, dict[str, Any] | None]]) -> Goodput:
    """`rows`: the job's metrics rows in step order (a step's later rows, e.g. written again by a
    supervisor that took over, are left out); `events`: (kind, data) of its events."""
    g = Goodput()
    first: float | None = None
    last: float | None = None
    step = -1
    for r in rows:
        if int(r["step"]) <= step:
            continue
        step = int(r["step"])
        g.steps += 1
        try:
            end, took = float(r["end_time"]), float(r["step_time_s"])
        except (KeyError, TypeError, ValueError):  # a row without times (an old job's): counted, not timed
            continue
        g.step_s += took
        first = end - took if first is None else first
        last = end
    if first is not None and last is not None:
        g.wall_s = max(0.0, last - first)
    for kind, data in events:
        if kind not in PAUSE_EVENTS or not data:
            continue
        if kind == "recovered":
            g.lost_steps += int(data.get("lost_steps") or 0)
        pause = data.get("pause_s")
        if not isinstance(pause, int | float):  # a pause its rows could not time
            continue
        cause = str(data.get(PAUSE_EVENTS[kind]) or kind)  # (both events always name it; kept apart if not)
        g.pauses += 1
        g.paused_s += float(pause)
        g.by_cause[cause] = g.by_cause.get(cause, 0.0) + float(pause)
    return g


class _Store(Protocol):
    def metrics(self, job_id: str, after_step: int = -1, limit: int = 10000) -> list[dict[str, Any]]: ...
    def events(self, job_id: str, after_id: int = 0, limit: int = 1000) -> list[Any]: ...


def job_goodput(store: _Store, job_id: str) -> Goodput:
    """The goodput of a stored job, reading its rows and events page by page."""
    return goodput_of(_rows(store, job_id), _events(store, job_id))


def _rows(store: _Store, job_id: str) -> Iterator[dict[str, Any]]:
    after = -1
    while page := store.metrics(job_id, after, _PAGE):
        yield from page
        after = int(page[-1]["step"])  # (the rest of a step cut by the page is left out: counted once anyway)
        if len(page) < _PAGE:
            return


def _events(store: _Store, job_id: str) -> Iterator[tuple[str, dict[str, Any] | None]]:
    after = 0
    while page := store.events(job_id, after, _PAGE):
        yield from ((e.kind, e.data) for e in page)
        after = page[-1].id
        if len(page) < _PAGE:
            return
