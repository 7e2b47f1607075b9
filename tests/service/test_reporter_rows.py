"""The supervisor's metrics rows reach metrics.jsonl in step order, each once, even when rank 0's notes
arrive out of order (a threaded actor takes them in any order)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from service.spec import JobSpec
from service.supervisor import reporter as reporter_mod
from service.supervisor.context import JobRun
from service.supervisor.reporter import Reporter
from workers.protocol import Formed


def _reporter(tmp_path: Path, restarted: bool = False) -> tuple[JobRun, Reporter]:
    run = JobRun(job_id="j", spec=JobSpec.model_validate({"name": "rows"}), namespace="t", store=None,
                 restarted=restarted, self_handle=None, mp=1, cp_tp=1, per_worker={"CPU": 1.0}, dp_min=1, dp_max=1,
                 output_dir=tmp_path)  # fmt: skip
    rep = Reporter(run, None)
    rep.open_outputs()
    return run, rep


def _row(step: int) -> dict[str, Any]:
    return {"step": step, "loss": 1.0 / step, "generation": 0}


def _written(tmp_path: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_a_row_before_its_predecessor_waits_for_it(tmp_path: Path) -> None:
    run, rep = _reporter(tmp_path)
    run.pending_rows[2] = _row(2)  # step 2's note came first
    rep.flush_metrics()
    assert rep.last_row_step == 0  # held: step 1 may still come
    run.pending_rows[1] = _row(1)
    rep.flush_metrics()
    rep.close_outputs()
    assert _written(tmp_path) == [1, 2]


def test_a_gap_is_written_past_after_the_hold_or_when_forced(tmp_path: Path, monkeypatch: Any) -> None:
    run, rep = _reporter(tmp_path)
    run.pending_rows[1] = _row(1)
    run.pending_rows[3] = _row(3)
    rep.flush_metrics()
    assert rep.last_row_step == 1  # 3 waits for 2
    monkeypatch.setattr(reporter_mod, "ROW_GAP_HOLD_S", 0.0)
    rep.flush_metrics()
    assert rep.last_row_step == 3  # step 2 never came: not held forever
    run.pending_rows[2] = _row(2)  # too late: a step is written once, in order
    run.pending_rows[5] = _row(5)
    monkeypatch.setattr(reporter_mod, "ROW_GAP_HOLD_S", 60.0)
    rep.flush_metrics(force=True)  # a restore target or the end: nothing waits
    rep.close_outputs()
    assert _written(tmp_path) == [1, 3, 5] and not run.pending_rows


def test_a_restarted_supervisor_measures_the_first_pause_from_the_rows_written_before(tmp_path: Path) -> None:
    """The rows its crashed predecessor wrote (metrics.jsonl) seed the pause clock: the first re-form
    after the restart gets its pause, and the last row is known at once."""
    run, rep = _reporter(tmp_path)
    for step in (1, 2):
        run.pending_rows[step] = {**_row(step), "end_time": 100.0 + step, "step_time_s": 0.5}
    rep.flush_metrics()
    rep.close_outputs()
    run, rep = _reporter(tmp_path, restarted=True)
    assert rep.last_row_step == 2 and rep.last_row is not None and rep.last_row["step"] == 2
    told: list[tuple[str, dict[str, Any]]] = []
    rep.event = lambda kind, message, **data: told.append((kind, data))  # type: ignore[method-assign]
    rep.pauses.formed_for(1, "growth")
    # The grown generation's ranks said where their part of the pause went; an older one's note is not its.
    run.formed = {
        "w0": Formed("w0", 1, 0, 103.0, step=2, restored={}, timings={"join_s": 0.02, "tiers_s": 0.27}),
        "w1": Formed("w1", 1, 1, 103.0, step=2, restored={}, timings={"join_s": 0.05, "tiers_s": 0.03}),
        "w2": Formed("w2", 0, 0, 90.0, step=0, restored={}, timings={"join_s": 9.0}),
    }
    run.pending_rows[3] = {**_row(3), "generation": 1, "dp": 2, "end_time": 104.0, "step_time_s": 0.5}
    rep.flush_metrics()
    rep.close_outputs()
    resumed = [d for k, d in told if k == "resumed"]
    assert resumed == [{"generation": 1, "cause": "growth", "pause_s": 1.5, "dp": 2, "step": 3,
                        "rank_phases": {"join_s": 0.05, "tiers_s": 0.27}}], told
