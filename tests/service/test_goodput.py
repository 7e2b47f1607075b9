"""A job's goodput from its stored rows and pause events (service.goodput), on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest

from service import goodput
from service.goodput import goodput_of, job_goodput
from service.spec import parse_spec
from service.store import JobStore


def _row(step: int, end: float, took: float = 0.5, **kw: object) -> dict[str, object]:
    return {"step": step, "loss": 5.0, "end_time": end, "step_time_s": took, "dp": 2, "generation": 0, **kw}


def test_steps_pauses_and_the_rest_add_up_to_the_wall_time() -> None:
    # steps 1-3 back to back from t=100; a recovery pauses 2 s; step 4 ends 0.3 s later than its time.
    rows = [_row(1, 100.5), _row(2, 101.0), _row(3, 101.5), _row(4, 104.3), _row(5, 104.8)]
    events = [("status", None), ("recovered", {"kind": "worker_died", "pause_s": 2.0, "lost_steps": 1}),
              ("resumed", {"cause": "growth", "pause_s": 0.25}), ("resumed", {"cause": "growth", "pause_s": None})]
    g = goodput_of(rows, events)
    assert (g.steps, g.pauses, g.lost_steps) == (5, 2, 1)
    assert g.wall_s == pytest.approx(4.8) and g.step_s == pytest.approx(2.5)
    assert g.paused_s == pytest.approx(2.25) and g.other_s == pytest.approx(0.05)
    assert g.by_cause == {"worker_died": 2.0, "growth": 0.25}
    assert g.ratio == pytest.approx(2.5 / 4.8)
    assert g.summary() == ("0.52 of 4.8s since step 1 in steps; paused 2.2s in 2 re-forms (worker_died 2.0s, growth 0.2s); "
                           "1 step trained again")


def test_the_summary_line_says_only_what_happened() -> None:
    assert goodput_of([], []).summary() == "-"
    assert goodput_of([_row(1, 10.5), _row(2, 11.0)], []).summary() == "1.00 of 1.0s since step 1 in steps"
    one = goodput_of([_row(1, 10.5), _row(2, 12.0)], [("resumed", {"cause": "growth", "pause_s": 1.0})])
    assert one.summary() == "0.50 of 2.0s since step 1 in steps; paused 1.0s in 1 re-form (growth 1.0s)"


def test_a_step_written_twice_counts_once_and_rows_without_times_are_not_timed() -> None:
    g = goodput_of([_row(1, 10.5), _row(1, 10.6), {"step": 2, "loss": 4.0}, _row(3, 11.5)], [])
    assert g.steps == 3 and g.step_s == pytest.approx(1.0) and g.wall_s == pytest.approx(1.5)
    assert goodput_of([], []).ratio is None and goodput_of([{"step": 1}], []).ratio is None


def test_read_from_the_store_page_by_page(job_store: JobStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(goodput, "_PAGE", 3)  # pages end inside the rows and the events
    job, _ = job_store.create_job(parse_spec({"name": "g"}), "alice", min_world=1, max_world=2)
    job_store.add_metrics(job.id, [_row(s, 100.0 + 0.5 * s) for s in range(1, 8)])
    for i in range(4):
        job_store.add_event(job.id, "resumed", f"pause {i}", {"cause": "scheduler", "pause_s": 0.1})
    job_store.add_event(job.id, "recovered", "r", {"kind": "node_died", "pause_s": 1.0, "lost_steps": 0})
    g = job_goodput(job_store, job.id)
    assert (g.steps, g.pauses) == (7, 5)
    assert g.by_cause == pytest.approx({"scheduler": 0.4, "node_died": 1.0})
    assert g.step_s == pytest.approx(3.5) and g.wall_s == pytest.approx(3.5)
