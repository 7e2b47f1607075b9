"""The root cause of a failure is named deterministically, and the failure policy's refusal is the
job's reason.

A rank whose step raises breaks its peers' collectives: they fail too, and their errors can reach the
supervisor before the raising rank's own (it reports after leaving its group). The supervisor names
the step error of that rank, never a broken collective, and with max_recoveries=0 the job fails with
the policy's reason instead of recovering.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from service.policies import FailureKind
from service.supervisor.detection import Failure, root_cause
from service.supervisor.pool import Slot
from tests.runtime.jobs import JobRun, assert_no_leaks, tiny_spec


def _failure(kind: FailureKind, rank: int | None) -> Failure:
    slots = [] if rank is None else [Slot(f"job-x/worker-{rank}", None, 0, 0, rank=rank)]
    return Failure(kind, slots, f"{kind} of {rank}", t_detect=0.0)


def test_a_failure_of_its_own_outranks_broken_collectives_in_any_order() -> None:
    step = _failure(FailureKind.STEP_ERROR, 1)
    died = _failure(FailureKind.WORKER_DIED, 3)
    broken = [_failure(FailureKind.COLLECTIVE_ERROR, None) for _ in range(3)]
    for found in ([*broken, step], [step, *broken], [broken[0], step, broken[1]]):
        assert root_cause(found) is step
    assert root_cause([died, *broken, step]) is step  # the lowest rank of the failures of their own
    assert root_cause(broken).kind == FailureKind.COLLECTIVE_ERROR


def test_step_error_is_named_and_refused_with_the_policy_reason(head_cluster: Any, tmp_path: Path) -> None:
    chaos = [{"kind": "raise_in_step", "step": 2, "rank": 1}]
    run = JobRun(tiny_spec(tmp_path, steps=6, chaos=chaos, ft={"max_recoveries": 0}))
    try:
        status = run.wait()
        assert status["state"] == "FAILED", run.kinds()
        detected = run.of("failure_detected")
        assert [e["data"]["kind"] for e in detected] == ["step_error"], detected
        assert detected[0]["data"]["ranks"] == [1] and detected[0]["data"]["recover"] is False, detected
        assert "not recovering: max_recoveries=0 reached" in status["reason"], status["reason"]
        assert "recovered" not in run.kinds() and not run.of("generation")[1:], run.kinds()
    finally:
        run.finish()
    assert_no_leaks(run.job_id)
