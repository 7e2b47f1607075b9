"""A recovery never restarts from step 0 silently.

A job that keeps no state (no snapshots, no persistent checkpoints) loses a worker after it trained:
it fails, saying why and naming the setting that allows a restart from scratch. With that setting it
starts again from step 0, and an event says so; the steps it trains again are not written twice.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.runtime.jobs import JobRun, assert_no_leaks, tiny_spec

KILL = [{"kind": "kill_worker", "step": 3, "rank": 1}]
NO_STATE = {"in_memory_every": 0, "persist_every": 0}


def test_no_state_after_progress_fails_with_the_reason(head_cluster: Any, tmp_path: Path) -> None:
    run = JobRun(tiny_spec(tmp_path, steps=6, dp=2, chaos=KILL, ckpt=NO_STATE))
    st = run.wait()
    run.finish()
    assert st["state"] == "FAILED", run.kinds()
    reason = str(st["reason"])
    assert "reached step 3" in reason and "fault_tolerance.restart_from_scratch" in reason, reason
    assert "checkpoint.in_memory_every" in reason, reason  # the other fix: keep state
    assert "restarted_from_scratch" not in run.kinds()
    assert [r["step"] for r in run.rows()] == [1, 2, 3]
    assert_no_leaks(run.job_id)


def test_restart_from_scratch_when_allowed_is_an_event(head_cluster: Any, tmp_path: Path) -> None:
    spec = tiny_spec(tmp_path, steps=6, dp=2, chaos=KILL, ckpt=NO_STATE, ft={"restart_from_scratch": True})
    run = JobRun(spec)
    st = run.wait()
    run.finish()
    assert st["state"] == "SUCCEEDED", run.kinds()
    told = run.of("restarted_from_scratch")
    assert len(told) == 1, run.kinds()
    assert "from step 0" in told[0]["message"] and "restart_from_scratch allows it" in told[0]["message"]
    recovered = run.of("recovered")
    assert recovered and recovered[0]["data"]["restored_step"] == 0 and recovered[0]["data"]["lost_steps"] == 3
    assert [r["step"] for r in run.rows()] == list(range(1, 7)), "a re-trained step was written twice"
    assert_no_leaks(run.job_id)
