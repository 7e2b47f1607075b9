"""The supervisor's writes to the job store, in order, on a thread of their own, never dropped silently.

The watch loop must not stall while the store is down (a PostgreSQL restart takes seconds, a failover
longer): events, states, metrics rows, checkpoints and output lines are queued here and written in the
order they happened. A write that fails because the store is unreachable is retried, with backoff, for
as long as the job lives; the first failure is an event (in the supervisor's own list at once, and in
the store once it is back) and the failed attempts a metric. A write the store refuses for any other
reason can never succeed: it is reported as an event and skipped, so it does not hold the rest.

`stored_row_step` is the last metrics row the store has (or refused for good, which was reported: a
re-run would be refused again): the committer commits snapshots only up to it, so a supervisor that
crashes with rows still held re-runs those steps instead of skipping them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from service.supervisor.words import first_line
from workers import telemetry

log = logging.getLogger("unbroken.supervisor")

# Each attempt gives the store this long (its own retries) before the writer takes over: the writer
# reports the trouble after one attempt instead of after the store's whole retry budget.
ATTEMPT_RETRY_S = 1.0
_BACKOFF_S = (0.2, 5.0)  # first and longest pause between attempts of a held write
_DRAIN_S = 600.0  # at the job's end, how long its last writes (the final status) may wait for the store


@dataclass
class _Write:
    what: str  # e.g. "event", "status", "metrics": for the messages
    call: Callable[[], None]
    row_step: int | None = None  # a metrics write: the last step it carries


class StoreWriter:
    """One job's ordered writes to the store. `report(kind, message, **data)` is how it tells the job
    (the reporter's event, which queues its own store write behind the held ones)."""

    def __init__(self, store: Any, job_id: str, report: Callable[..., None]) -> None:
        from service.store import store_unavailable

        self._store = store
        self._job_id = job_id
        self._report = report
        self._unavailable = store_unavailable
        self._queue: deque[_Write] = deque()
        self._cv = threading.Condition()
        self._busy = False
        self._closed = False
        self.stored_row_step = 0
        self.failures = 0  # failed attempts, in all
        self._thread = threading.Thread(target=self._loop, name="store-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ what the reporter queues
    def put(self, what: str, fn: Callable[..., None], *args: Any, row_step: int | None = None) -> None:
        with self._cv:
            self._queue.append(_Write(what, lambda: fn(*args), row_step))
            self._cv.notify()

    def backlog(self) -> int:
        with self._cv:
            return len(self._queue) + (1 if self._busy else 0)

    def drain(self, timeout_s: float = _DRAIN_S, *, quiet: bool = False) -> bool:
        """Wait until every queued write is in the store (the job's end); False if it timed out (said,
        as lost writes, unless `quiet`: a short wait whose writes are still held)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    if quiet:
                        return False
                    log.error("job %s: %d write(s) to the job store could not be made in %.0f s and are lost",
                              self._job_id, len(self._queue) + int(self._busy), timeout_s)
                    return False
                self._cv.wait(min(left, 0.5))
            return True

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    # ------------------------------------------------------------------ the writer thread
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                w = self._queue[0]
                self._busy = True
            self._write(w)
            with self._cv:
                self._queue.popleft()
                self._busy = False
                self._cv.notify_all()
                backlog = len(self._queue)
            if w.row_step is not None:
                self.stored_row_step = max(self.stored_row_step, w.row_step)
            telemetry.record_store_writes(self._job_id, backlog, self.failures)

    def _write(self, w: _Write) -> None:
        """Write `w`, retrying while the store is unreachable; report trouble once and its end once."""
        pause, down_since = _BACKOFF_S[0], None
        while True:
            try:
                w.call()
                break
            except Exception as e:  # noqa: BLE001 - every failure is reported below, none is swallowed
                self.failures += 1
                telemetry.record_store_writes(self._job_id, self.backlog(), self.failures)
                if not self._unavailable(e):
                    log.error("job %s: the job store refused a %s write: %s", self._job_id, w.what, e)
                    self._report("store_write_failed",
                                 f"The job store refused a {w.what} write, which is skipped: "
                                 f"{type(e).__name__}: {first_line(e)}", what=w.what, error=first_line(e))
                    return
                if down_since is None:
                    down_since = time.monotonic()
                    self._report("store_unavailable",
                                 f"The job store cannot be reached ({type(e).__name__}: {first_line(e)}); "
                                 f"{self.backlog()} write(s) are held in order and retried until it is back. "
                                 "Training goes on; snapshots are committed only up to the last metrics row "
                                 "the store has.", what=w.what)
                time.sleep(pause)
                pause = min(pause * 2, _BACKOFF_S[1])
        if down_since is not None:
            self._report("store_available",
                         f"The job store is back after {time.monotonic() - down_since:.1f}s; the held writes "
                         "are being written in order, none was lost.", down_s=time.monotonic() - down_since)
