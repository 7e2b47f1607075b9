"""Everything a supervisor tells the world: events, job states, the store, metrics.jsonl, TensorBoard,
telemetry and the job's output lines (a recovery's own `recovered` event: service.supervisor.recovery_clock).

Events go to an in-actor list (`unbroken run` polls it) and, with a store, to the job store: every
store write goes through the job's StoreWriter, in order, off the watch loop, never dropped silently.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from service.state_machine import STORE_STATUS, JobState
from service.supervisor.context import JobRun
from service.supervisor.pauses import Pause, PauseClock
from service.supervisor.recovery_clock import RecoveryClock, slowest_phases
from service.supervisor.store_writer import StoreWriter
from service.supervisor.words import first_line
from workers import telemetry
from workers.protocol import CheckpointReport, Note

log = logging.getLogger("unbroken.supervisor")

_LOG_FLUSH_S = 0.5  # how often the job's output lines go to the store
_HEARTBEAT_GAUGE_S = 1.0  # how often heartbeat ages are exported
ROW_GAP_HOLD_S = 2.0  # how long a metrics row waits for an earlier step's that has not come yet


class Reporter:
    def __init__(self, run: JobRun, output: Any) -> None:
        self.run = run
        self._output = output  # this actor's captured output (workers.log_capture)
        self.events: list[dict[str, Any]] = []
        self.warnings: list[str] = []
        self._logs: list[tuple[float, str | None, str]] = []  # (time, source, line), flushed to the store
        self._logs_flushed_at = 0.0
        self._heartbeats_exported_at = 0.0
        self._metrics_log: Any = None
        self._tb: Any = None  # workers.tensorboard.TensorBoardLog when the spec asks for it
        self._gap_since: float | None = None  # since when a row waits for an earlier step's (flush_metrics)
        self.last_row_step = 0  # the last step whose metrics row is written
        self.last_row: dict[str, Any] | None = None
        self.checkpoints_written = 0  # persistent checkpoints this supervisor saw written
        self.recoveries = RecoveryClock(run, self.event, lambda: self._tb)
        self.pauses = PauseClock()  # the controller names why each generation forms
        self.writer = StoreWriter(run.store, run.job_id, self.event) if run.store is not None else None

    def settle_store(self, timeout_s: float = 2.0) -> None:
        """Before a recovery chooses its snapshot: let the queued rows reach the store (they were written
        asynchronously a moment ago), so the commit is not held a step or two behind. A store that is
        down costs this wait once and the commit stays where the store's rows are."""
        if self.writer is not None:
            self.writer.drain(timeout_s, quiet=True)

    @property
    def committable_step(self) -> int:
        """Snapshots are committed up to here: the last metrics row written to metrics.jsonl and, with a
        store, to the store (a restore never skips a step whose row was lost)."""
        if self.writer is None:
            return self.last_row_step
        return min(self.last_row_step, self.writer.stored_row_step)

    # ----------------------------------------------------------------- events and states
    def event(self, kind: str, message: str, /, **data: Any) -> None:
        ev = {"id": 0, "ts": time.time(), "kind": kind, "message": message, "data": data}
        with self.run.lock:
            ev["id"] = len(self.events) + 1
            self.events.append(ev)
        log.info("job %s: %s: %s", self.run.job_id, kind, message)
        if self.writer is not None:
            self.writer.put(kind, self.run.store.add_event, self.run.job_id, kind, message, data or None)

    def to(self, state: JobState, reason: str = "") -> None:
        run = self.run
        prev = run.sm.state
        run.sm.to(state, reason)
        self.event("state", f"{prev.value} -> {state.value}" + (f": {reason}" if reason else ""),
                   source=prev.value, target=state.value)
        if self.writer is not None and (STORE_STATUS[prev] != STORE_STATUS[state] or prev == JobState.STARTING):
            self.writer.put("status", run.store.set_status, run.job_id, STORE_STATUS[state], reason or None)

    def conclude(self, state: JobState, reason: str, kind: str, message: str, /, **data: Any) -> None:
        """A final status and the event that explains it, the event first: whoever sees the status finds
        the event (the store writes them in this order)."""
        self.event(kind, message, **data)
        if self.run.sm.can(state):
            self.to(state, reason)

    def fail(self, reason: str, tb: str | None = None) -> None:
        self.run.reason = reason
        self.conclude(JobState.FAILED, reason, "failed", reason, **({"traceback": tb} if tb else {}))

    def on_checkpoint(self, note: CheckpointReport) -> None:
        """Rank 0's note about a persistent checkpoint."""
        run = self.run
        if not note.ok and (note.abandoned or note.generation < run.generation):
            # Its group broke under it (a failure, reported as such): not a storage problem.
            log.info("checkpoint of step %s abandoned with generation %s: %s", note.step, note.generation,
                     note.error)
            return
        if note.ok:
            self.checkpoints_written += 1
            self.event("checkpointed", f"Persistent checkpoint of step {note.step} written to {note.uri}.",
                       step=note.step, uri=note.uri, tier=note.tier)
            if self.writer is not None:
                self.writer.put("checkpoint", run.store.add_checkpoint, run.job_id, note.step, str(note.uri),
                                note.tier)
        else:
            self.event("checkpoint_failed", f"The persistent checkpoint of step {note.step} failed: "
                       f"{first_line(note.error)}", step=note.step, error=note.error)

    # ----------------------------------------------------------------- output files
    def open_outputs(self) -> None:
        """metrics.jsonl (continued after the rows already written when restarted) and TensorBoard."""
        from workers.metrics_log import MetricsLog, read_metrics

        run = self.run
        metrics_path = run.output_dir / "metrics.jsonl"
        if run.restarted and metrics_path.exists():  # go on after the rows already written
            written = read_metrics(metrics_path)
            self.last_row_step = max([int(r["step"]) for r in written] + [0])
            if written:  # the last row before our restart: the next re-form's pause is measured from it
                self.last_row = written[-1]
                self.pauses.start_after(self.last_row)
            self._resend_rows_the_store_lacks(written)
        self._metrics_log = MetricsLog(metrics_path, truncate=not run.restarted)
        if run.spec.tensorboard:
            from workers.tensorboard import TensorBoardLog

            self._tb = TensorBoardLog(run.output_dir / "tensorboard")

    def _resend_rows_the_store_lacks(self, written: list[dict[str, Any]]) -> None:
        """After our own restart: rows the crashed instance wrote to metrics.jsonl but still held for
        the store (it was down) go to the store now, in order."""
        if self.writer is None:
            return
        rec = self._stored_job()
        stored = int(((rec.progress if rec is not None else None) or {}).get("step", 0) or 0)
        self.writer.stored_row_step = stored
        missing = [r for r in written if int(r["step"]) > stored]
        if missing:
            log.info("job %s: %d metrics row(s) the store lacks are written again", self.run.job_id, len(missing))
            self.writer.put("metrics", self.run.store.add_metrics, self.run.job_id, missing,
                            row_step=int(missing[-1]["step"]))

    def _stored_job(self, within_s: float = 60.0) -> Any:
        """The job's record in the store (None without one), waiting out a store outage for `within_s`:
        a supervisor that restarts while PostgreSQL restarts too must not fail the job for it."""
        if self.run.store is None:
            return None
        deadline = time.monotonic() + within_s
        while True:
            try:
                return self.run.store.get_job(self.run.job_id)
            except Exception as e:
                if time.monotonic() > deadline:
                    raise
                log.warning("job %s: the store cannot be read yet (%s); retrying", self.run.job_id, first_line(e))
                time.sleep(1.0)

    def newest_log_times(self) -> dict[str, float] | None:
        """After our own restart: {source: its newest line's time} in the job's logs (None without a store,
        or when it cannot be read: the lines the workers kept are then not asked back)."""
        if self.run.store is None:
            return None
        try:
            return self.run.store.newest_log_times(self.run.job_id)
        except Exception as e:  # noqa: BLE001 - logs lost meanwhile are said, not fatal
            log.warning("job %s: the logs' newest lines could not be read: %s", self.run.job_id, first_line(e))
            return None

    def stored_recoveries(self) -> int | None:
        """After our own restart: the recoveries the job has been through (the store counts every move to
        RECOVERING), so the count and fault_tolerance.max_recoveries go on from there. None without a store
        or when it cannot be read."""
        try:
            rec = self._stored_job()
        except Exception as e:  # noqa: BLE001 - the count starts from this instance's own, and says so
            log.warning("job %s: the recoveries so far could not be read: %s", self.run.job_id, first_line(e))
            return None
        return int(rec.recoveries) if rec is not None else None

    def close_outputs(self) -> None:
        """The job's end: its files closed and its last store writes (the final status) made."""
        if self.writer is not None:
            self.writer.drain()
            self.writer.close()
        with contextlib.suppress(Exception):
            self._metrics_log.close()
        if self._tb is not None:
            with contextlib.suppress(Exception):
                self._tb.close()

    # ----------------------------------------------------------------- the job's output lines
    def add_logs(self, source: str, lines: list[Any]) -> None:
        """Worker output lines from a note (flushed to the store in batches)."""
        if self.run.store is None:
            return
        with self.run.lock:
            self._logs.extend((float(t), source, str(line)) for t, _stream, line in lines)

    def maybe_flush_logs(self) -> None:
        if time.monotonic() - self._logs_flushed_at > _LOG_FLUSH_S:
            self._logs_flushed_at = time.monotonic()
            self.flush_logs()

    def flush_logs(self) -> None:
        """The job's output lines (workers' and this supervisor's) to the store, in batches."""
        if self.run.store is None:
            return
        own = [(t, "supervisor", line) for t, _stream, line in self._output.drain()]
        with self.run.lock:
            lines, self._logs = self._logs + own, []
        if lines and self.writer is not None:
            lines.sort(key=lambda x: x[0])
            self.writer.put("logs", self.run.store.add_logs, self.run.job_id, lines)

    # ----------------------------------------------------------------- metrics
    def flush_metrics(self, *, force: bool = False) -> None:
        """Rows in step order, each step once (a step re-run after a recovery is not written again).

        Rank 0's notes reach a threaded actor in any order, so a row whose step follows a gap waits up
        to ROW_GAP_HOLD_S for the missing one (else that row, arriving next, would be dropped as old);
        `force` (a recovery's restore target, the end) writes past any gap at once."""
        run = self.run
        now = time.monotonic()
        with run.lock:
            rows = []
            for step in sorted(run.pending_rows):
                if step <= self.last_row_step:
                    del run.pending_rows[step]
                    continue
                if step != self.last_row_step + 1 and not force:
                    self._gap_since = self._gap_since if self._gap_since is not None else now
                    if now - self._gap_since < ROW_GAP_HOLD_S:
                        break
                rows.append(run.pending_rows.pop(step))
                self.last_row_step = step
                self._gap_since = None
        if not rows:
            return
        for r in rows:
            self._metrics_log.write(r)
            if self._tb is not None:
                self._tb.log_line(r)
        self.last_row = rows[-1]
        if self.writer is not None:
            self.writer.put("metrics", run.store.add_metrics, run.job_id, rows, row_step=int(rows[-1]["step"]))
        for pause in self.pauses.rows(rows):
            self._tell_pause(pause)
        self.recoveries.on_rows(rows)

    def _tell_pause(self, p: Pause) -> None:
        """Exported by cause; a recovery's goes into its `recovered` event, any other's is said now."""
        telemetry.record_pause(self.run.job_id, p.cause, p.seconds)
        if self.recoveries.take_pause(p):
            return
        # Where the pause went on the ranks, as a recovery's event says it: from the `formed` notes that
        # came (sent before a rank's first step; rarely one is still on its way when the row comes).
        with self.run.lock:
            formed = [m for m in self.run.formed.values() if m.generation == p.generation]
        self.event("resumed", f"Training resumed at dp={p.dp} with step {p.step}, after a pause of {p.seconds:.2f}s "
                   f"({p.cause}).", generation=p.generation, cause=p.cause, pause_s=round(p.seconds, 4), dp=p.dp,
                   step=p.step, rank_phases=slowest_phases(formed))

    def export_heartbeat_ages(self, slots: list[Any], hbs: dict[str, tuple[float, Note]],
                              now: float) -> None:  # fmt: skip
        if now - self._heartbeats_exported_at < _HEARTBEAT_GAUGE_S:
            return
        self._heartbeats_exported_at = now
        # Ray drops a gauge that is not set again within ~20 s from its export: the group's shape is
        # re-set with the heartbeat ages (still by its one owner, the supervisor).
        telemetry.record_group(self.run.job_id, self.run.dp, self.run.generation)
        for s in slots:
            seen = hbs.get(s.name, (None, None))[0]
            if seen is not None and s.rank >= 0:
                telemetry.record_heartbeat_age(self.run.job_id, s.rank, max(0.0, now - seen))
