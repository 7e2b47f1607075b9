"""How long training paused at each re-form, as the job's own rows tell it.

A re-form's pause runs from the last step one generation completed to the first step the next one
completed, less that step's own time: what a recovery, a grow or a shrink cost in training time (the
goodput benchmark counts its pauses the same way). The reporter feeds the rows it writes, in step
order; the controller says at each launch why the generation forms (a failure's kind, growth, ...).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

OTHER = "re-form"  # the cause of a generation no launch named (the controller names every one it launches)


@dataclass(frozen=True)
class Pause:
    generation: int  # the generation that ended the pause
    cause: str
    seconds: float
    dp: int
    step: int  # the first step it completed


class PauseClock:
    def __init__(self) -> None:
        self._last: dict[str, Any] | None = None  # the last row written
        self._causes: dict[int, str] = {}  # generation -> why it formed
        self._formed: tuple[int, float] | None = None  # the last generation launched, and when (monotonic)

    def formed_for(self, generation: int, cause: str) -> None:
        """Generation `generation` is launched because of `cause` (a small set: it is a metric's label)."""
        self._causes[generation] = cause
        self._formed = (generation, time.monotonic())

    def reforming_for(self) -> float:
        """Seconds since the last re-form (a recovery, a grow, a shrink) launched its generation, while
        that generation has completed no step; infinity otherwise."""
        if self._formed is None:
            return math.inf
        generation, at = self._formed
        last = self._last.get("generation") if self._last is not None else None
        return math.inf if isinstance(last, int) and last >= generation else time.monotonic() - at

    def start_after(self, row: dict[str, Any]) -> None:
        """The next pause is measured from `row` (the last one an earlier supervisor wrote)."""
        self._last = row

    def rows(self, rows: list[dict[str, Any]]) -> list[Pause]:
        """The pauses that these rows (the next ones written, in step order) end."""
        out: list[Pause] = []
        for r in rows:
            last, self._last = self._last, r
            gen = r.get("generation")
            if last is None or gen is None or gen == last.get("generation"):
                continue
            try:
                seconds = float(r["end_time"]) - float(last["end_time"]) - float(r["step_time_s"])
            except (KeyError, TypeError, ValueError):  # a row without times: no figure rather than a wrong one
                continue
            cause = self._causes.get(int(gen), OTHER)
            for g in [g for g in self._causes if g <= int(gen)]:  # (and those an interrupted recovery left)
                del self._causes[g]
            out.append(Pause(int(gen), cause, max(0.0, seconds), int(r.get("dp") or 0), int(r["step"])))
        return out
