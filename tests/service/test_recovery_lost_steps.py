"""A recovery's lost steps count what the failed generation trained, by the survivors' own word, even
where rank 0's last metrics row had not reached the supervisor when the failure was taken."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from service.spec import JobSpec
from service.supervisor.context import JobRun
from service.supervisor.recovery_clock import RecoveryClock, RecoveryTiming
from workers.protocol import Formed


def _clock(tmp_path: Path) -> tuple[JobRun, RecoveryClock, list[tuple[str, dict[str, Any]]]]:
    run = JobRun(job_id="j", spec=JobSpec.model_validate({"name": "lost"}), namespace="t", store=None,
                 restarted=False, self_handle=None, mp=1, cp_tp=1, per_worker={"CPU": 1.0}, dp_min=1, dp_max=2,
                 output_dir=tmp_path)  # fmt: skip
    run.dp = 1
    events: list[tuple[str, dict[str, Any]]] = []
    clock = RecoveryClock(run, lambda what, _msg, **data: events.append((what, data)), lambda: None)
    return run, clock, events


def _recover(run: JobRun, clock: RecoveryClock, *, heard: int, trained_to: int, restored: int) -> None:
    """Generation 0 failed after the supervisor heard step `heard`; the survivor, rank 0 of generation 1,
    had trained to `trained_to` and restored `restored`; generation 1 then completes a step."""
    now = time.time()
    clock.begin(RecoveryTiming(kind="worker_died", cause="a worker's death", t_fault=now, t_detect=now,
                               t_launch=now, last_step=heard, generation=1))
    run.formed["w0"] = Formed("w0", 1, 0, now, step=restored, timings={},
                              restored={"step": restored, "source": "fresh" if restored == 0 else "memory",
                                        "trained_to": trained_to})
    clock.on_rows([{"step": restored + 1, "generation": 1, "end_time": now}])


def test_a_step_whose_row_came_late_is_counted_lost(tmp_path: Path) -> None:
    run, clock, events = _clock(tmp_path)
    _recover(run, clock, heard=2, trained_to=3, restored=0)
    recovered = [d for k, d in events if k == "recovered"]
    assert len(recovered) == 1 and recovered[0]["lost_steps"] == 3 and recovered[0]["last_step"] == 3
    scratch = [d for k, d in events if k == "restarted_from_scratch"]
    assert scratch and scratch[0]["last_step"] == 3


def test_a_survivor_behind_what_was_heard_does_not_lower_the_count(tmp_path: Path) -> None:
    # A worker that sat out the failed generation (e.g. rejoining at a grow) trained to an older step.
    run, clock, events = _clock(tmp_path)
    _recover(run, clock, heard=7, trained_to=4, restored=6)
    recovered = [d for k, d in events if k == "recovered"]
    assert recovered[0]["lost_steps"] == 1 and recovered[0]["last_step"] == 7
