"""A recovery under way, timed from its fault to its generation's first completed step, and its one
`recovered` event: the cause first, then detect, re-form, restore and replay, the steps lost, the ranks
that trained on in place, and the pause of training it cost (service.supervisor.pauses).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from service.supervisor.context import JobRun
from service.supervisor.pauses import Pause
from service.supervisor.words import SOURCE_WORDS, fmt_s
from service.text import plural


def slowest_phases(notes: list[Any]) -> dict[str, float]:
    """Where a re-form went on the ranks (join, build, tiers, restore and its parts), from their `formed`
    notes: each phase's slowest rank, the one the others waited for."""
    keys = sorted({k for m in notes for k in m.timings})
    return {k: round(max(float(m.timings.get(k, 0.0)) for m in notes), 4) for k in keys}


@dataclass
class RecoveryTiming:
    """A recovery in progress, until its generation completes a step (then: one `recovered` event)."""

    kind: str
    cause: str
    t_fault: float | None
    t_detect: float
    t_launch: float
    last_step: int
    generation: int
    interrupted: int = 0  # earlier recoveries a new failure cut short before their first step
    failed: tuple[str, ...] = ()  # the workers whose failure it recovers from (fault_seen)
    failed_generation: int = -1  # the generation they failed in

    def after(self, earlier: RecoveryTiming | None) -> RecoveryTiming:
        """This recovery as the continuation of `earlier`, one a new failure interrupted: it is timed from
        the first failure (its fault and detection), as the job was not training in between."""
        if earlier is None:
            return self
        return replace(self, t_fault=earlier.t_fault, t_detect=earlier.t_detect, last_step=earlier.last_step,
                       cause=f"{self.cause} (after {earlier.cause}, whose recovery it interrupted)",
                       interrupted=earlier.interrupted + 1, failed=earlier.failed,
                       failed_generation=earlier.failed_generation)


class RecoveryClock:
    def __init__(self, run: JobRun, event: Callable[..., None], tb: Callable[[], Any]) -> None:
        self.run = run
        self.event = event  # the reporter's
        self._tb = tb  # the job's TensorBoard log, if any (made later than this clock)
        self.current: RecoveryTiming | None = None
        self._row: dict[str, Any] | None = None  # the new generation's first row, kept until formed
        self._pause: float | None = None  # the pause of training it cost, once its row came

    def begin(self, rec: RecoveryTiming) -> None:
        self.current, self._row, self._pause = rec, None, None

    def fault_seen(self, worker: str, generation: int, t_fault: float) -> None:
        """A node agent's word of a death that Ray reported first (with no time of its own): when the worker
        was last seen alive, which the current recovery takes as its fault time if it has none."""
        rec = self.current
        if rec is None or rec.t_fault is not None or generation != rec.failed_generation or worker not in rec.failed:
            return
        rec.t_fault = min(t_fault, rec.t_detect)

    def close(self) -> RecoveryTiming | None:
        """An earlier recovery still replaying ends here, with what it reached; it is returned when it was
        interrupted (no step yet), so the next recovery goes on timing it."""
        rec, row = self.current, self._row
        if rec is None:
            return None
        self._finish(rec, row)
        return rec if row is None else None

    def settle(self) -> None:
        """At the end of the job: a recovery whose first row came is told, even with a `formed` missing."""
        self._finish_when_formed(at_end=True)

    def on_rows(self, rows: list[dict[str, Any]]) -> None:
        """The rows just written, in step order: the failed generation's late ones raise the step it
        reached; the new generation's first ends the recovery (once its ranks' `formed` notes are in)."""
        rec = self.current
        if rec is not None:
            for r in rows:
                gen = r.get("generation")
                if gen is not None and gen < rec.generation:
                    # The failed generation reached this step, though its row came after the failure was taken.
                    rec.last_step = max(rec.last_step, int(r["step"]))
                elif gen == rec.generation and self._row is None:
                    self._row = r  # the generation's first row: rows come a few steps at a time
        self._finish_when_formed()

    def take_pause(self, p: Pause) -> bool:
        """Whether `p` is this recovery's pause (then its `recovered` event tells it)."""
        rec = self.current
        if rec is None or p.generation != rec.generation:
            return False
        self._pause = p.seconds
        return True

    def _finish_when_formed(self, *, at_end: bool = False) -> None:
        """The recovery ends at its generation's first row, told once every rank's `formed` note is in: a
        threaded actor may take a rank's first metrics before its `formed`, whose restore source the
        event names. At the end of the job it is told with what came."""
        rec, row = self.current, self._row
        if rec is None or row is None:
            return
        with self.run.lock:
            formed = sum(1 for m in self.run.formed.values() if m.generation == rec.generation)
        if at_end or formed >= self.run.dp * self.run.mp:
            self._finish(rec, row)

    def _finish(self, rec: RecoveryTiming, row: dict[str, Any] | None) -> None:
        """The one `recovered` event of a recovery, once its generation completed a step (`row`): the
        cause first, then the phases in order. With row=None the recovery was cut short (a new failure
        before its first step) and says so instead."""
        now = time.time()
        self.current, self._row = None, None
        if row is None:
            self.event("recovery_interrupted", f"The recovery into generation {rec.generation} was "
                       "interrupted by a new failure before its first step.", generation=rec.generation)
            return
        with self.run.lock:
            formed = dict(self.run.formed)
        t_formed = max((m.time for m in formed.values()), default=now)
        phases = slowest_phases(list(formed.values()))
        restore_s = phases.get("restore_s", 0.0)
        restored = min((int(m.restored.get("step", 0)) for m in formed.values()), default=0)
        # How far the failed generation got: what we heard, or further where a survivor trained a step
        # whose row had not reached us when the failure was taken.
        rec.last_step = max([rec.last_step, *(int(m.restored.get("trained_to") or 0) for m in formed.values())])
        sources = sorted({str(m.restored.get("source")) for m in formed.values()})
        fallback = sorted({str(m.restored["fallback_reason"]) for m in formed.values()
                           if m.restored.get("fallback_reason")})
        # Trained on in place: the worker says so, and it is the process and model object it had before.
        before = self.run.models_before
        kept = sorted(m.rank for w, m in formed.items() if m.restored.get("in_place")
                      and before.get(w) == (m.restored.get("pid"), m.restored.get("model_id")))
        # (clamped: a fault's time can come from another process's clock, a few ms ahead of ours)
        detect_s = max(0.0, rec.t_detect - rec.t_fault) if rec.t_fault else None
        reform_s = max(0.0, t_formed - rec.t_detect - restore_s)
        # The recovery ends when rank 0 completed the step (the row's end_time, as the fault's time, a
        # worker's clock), not when its note reached us: the relay's latency is not training lost.
        done = min(now, float(row.get("end_time") or now))
        replay_s = max(0.0, done - t_formed)
        total = done - (rec.t_fault or rec.t_detect)
        lost = max(0, rec.last_step - restored)
        tb = self._tb()
        if tb is not None:
            with contextlib.suppress(Exception):
                tb.log_recovery(int(row["step"]), int(rec.generation), str(rec.kind),
                                      f"restored step {restored} from {'/'.join(sources)}")
        where = " and ".join(SOURCE_WORDS.get(x, x) for x in sources)
        if "fresh" in sources and rec.last_step > 0:
            allowed = ("fault_tolerance.restart_from_scratch allows it" if self.run.ft.restart_from_scratch
                       else "the failure came before the first snapshot or checkpoint was saved")
            self.event("restarted_from_scratch", f"Generation {rec.generation} started again from step 0: there was "
                       f"no snapshot or persistent checkpoint to restore ({allowed}); {rec.last_step} step(s) "
                       "are trained again.", generation=rec.generation, last_step=rec.last_step)
        self.event(
            "recovered",
            f"Recovered from {rec.cause} in {total:.2f}s: detect {fmt_s(detect_s)}, re-form {reform_s:.2f}s, "
            f"restore {restore_s:.2f}s (step {restored} {where}), replay {replay_s:.2f}s; "
            f"{plural(lost, 'step')} lost; generation {rec.generation} completed step {row['step']}."
            + (f" {len(kept)} of {len(formed)} rank(s) trained on in the model they held." if kept else "")
            + (f" The in-memory snapshot could not be used: {fallback[0]}." if fallback else ""),
            generation=rec.generation, kind=rec.kind, restored_step=restored, source=sources,
            last_step=rec.last_step, lost_steps=lost,
            detect_s=detect_s, reform_s=reform_s, restore_s=restore_s, replay_s=replay_s, total_s=total,
            rank_phases=phases,
            first_step=row["step"], fallback_reason=fallback[0] if fallback else None, in_place_ranks=kept,
            interrupted=rec.interrupted, pause_s=self._pause,
        )
