"""The supervisor's store writer on a real job store (SQLite): writes land in order, a refused write is
reported and skipped without holding the rest, the stored-row mark follows only what was written, and
a store that cannot be reached is told once, retried, and nothing is dropped (private PostgreSQL)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from service.spec import parse_spec
from service.store import JobStore
from service.supervisor.store_writer import ATTEMPT_RETRY_S, StoreWriter
from tests.service.private_pg import private_postgres


def _job(store: JobStore) -> str:
    job, _ = store.create_job(parse_spec({"name": "writer"}), "alice", min_world=1, max_world=1)
    return job.id


def test_writes_in_order_and_a_refused_write_is_reported_not_holding_the_rest(tmp_path: Path) -> None:
    store = JobStore(f"sqlite:///{tmp_path / 'jobs.db'}", write_retry_s=ATTEMPT_RETRY_S)
    job = _job(store)
    told: list[tuple[str, str]] = []
    w = StoreWriter(store, job, lambda kind, message, **_: told.append((kind, message)))
    for step in range(1, 4):
        w.put("metrics", store.add_metrics, job, [{"step": step, "loss": 1.0}], row_step=step)
        w.put("event", store.add_event, job, "step", f"step {step}")
    w.put("metrics", store.add_metrics, job, [{"step": "four"}], row_step=4)  # refused: not an integer step
    w.put("event", store.add_event, job, "after", "written after the refused one")
    assert w.drain(30)
    w.close()
    assert [r["step"] for r in store.metrics(job)] == [1, 2, 3]
    # A row refused for good is reported and passed: holding commits back would not bring it back.
    assert w.stored_row_step == 4
    assert [k for k, _ in told] == ["store_write_failed"]
    assert "metrics" in told[0][1] and "integer 'step'" in told[0][1]
    messages = [e.message for e in store.events(job) if e.kind in ("step", "after")]
    assert messages == ["step 1", "step 2", "step 3", "written after the refused one"]


def test_an_unreachable_store_is_told_once_and_nothing_is_dropped() -> None:
    with private_postgres() as pg:
        store = JobStore(pg.url, write_retry_s=ATTEMPT_RETRY_S)  # as the supervisor opens it
        job = _job(store)
        told: list[str] = []
        lock = threading.Lock()

        def report(kind: str, message: str, **_: Any) -> None:
            with lock:
                told.append(kind)
            w.put(kind, store.add_event, job, kind, message)  # as the reporter does: behind the held writes

        w = StoreWriter(store, job, report)
        w.put("metrics", store.add_metrics, job, [{"step": 1, "loss": 1.0}], row_step=1)
        assert w.drain(30) and w.stored_row_step == 1
        pg.stop()
        for step in range(2, 12):
            w.put("metrics", store.add_metrics, job, [{"step": step, "loss": 1.0}], row_step=step)
        time.sleep(3)
        assert w.stored_row_step == 1 and w.backlog() >= 10, "rows counted as stored while the store was down"
        pg.start()
        assert w.drain(120)
        w.close()
        assert told.count("store_unavailable") == 1 and told.count("store_available") == 1, told
        assert w.failures >= 1
        assert [r["step"] for r in store.metrics(job)] == list(range(1, 12))
        assert w.stored_row_step == 11
        kinds = [e.kind for e in store.events(job)]
        assert kinds.index("store_unavailable") < kinds.index("store_available")
