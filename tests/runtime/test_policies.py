"""The supervisor's pure parts: state transitions, failure/scaling/straggler policies, rank layout."""

from __future__ import annotations

import pytest

from service.policies import FailurePolicy, ScalingPolicy, StragglerPolicy
from service.state_machine import ALLOWED, IllegalTransition, JobState, StateMachine


def test_state_machine_allows_the_lifecycle_and_refuses_the_rest() -> None:
    sm = StateMachine()
    for target in (JobState.RUNNING, JobState.RECOVERING, JobState.RUNNING, JobState.RESIZING, JobState.RUNNING,
                   JobState.FINISHING, JobState.SUCCEEDED):
        sm.to(target, "test")
    assert sm.terminal and [t.target for t in sm.history][-1] == JobState.SUCCEEDED
    with pytest.raises(IllegalTransition, match="SUCCEEDED -> RUNNING"):
        sm.to(JobState.RUNNING)
    assert not StateMachine().can(JobState.SUCCEEDED)  # never straight from STARTING
    for terminal in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED):
        assert ALLOWED[terminal] == frozenset()
    for live in (JobState.STARTING, JobState.RUNNING, JobState.RECOVERING, JobState.RESIZING, JobState.FINISHING):
        assert {JobState.FAILED, JobState.CANCELLED} <= ALLOWED[live]


def test_scaling_policy_takes_the_largest_dp_within_min_and_max() -> None:
    p = ScalingPolicy(dp_min=2, dp_max=4)
    assert p.choose(3) == 3
    assert p.choose(3, 2) == 4
    assert p.choose(1) is None and p.choose(1, 1) == 2
    assert p.wants_growth(3, 5) == 1 and p.wants_growth(4, 2) == 0 and p.wants_growth(2, 0) == 0
    # Ready replicas wait for those still starting (one pause), but not past grow_wait_s.
    assert p.grow_now(starting=0, ready_for_s=0.0)
    assert not p.grow_now(starting=1, ready_for_s=p.grow_wait_s / 2)
    assert p.grow_now(starting=1, ready_for_s=p.grow_wait_s)


def test_failure_policy_limits_recoveries_and_repeated_step_errors() -> None:
    p = FailurePolicy(max_recoveries=2)
    assert p.decide("worker_died", 0) == (True, "")
    ok, why = p.decide("worker_died", 2)
    assert not ok and "max_recoveries=2" in why
    assert not p.decide("build_error", 0)[0]
    assert p.decide("step_error", 0, step=5)[0] and p.decide("step_error", 1, step=5)[0]
    ok, why = FailurePolicy(max_recoveries=10, max_same_step_errors=2).decide("step_error", 0, step=1)
    assert ok


def test_straggler_policy_finds_the_rank_that_starts_late() -> None:
    p = StragglerPolicy(factor=3.0, patience=2)
    gaps = {"a": 0.01, "b": 0.01, "c": 0.01, "d": 1.0}  # d sleeps 1 s before each step
    times = {"a": 1.1, "b": 1.1, "c": 1.1, "d": 0.1}  # the others wait for it inside the step
    assert p.observe(gaps, times) == []
    assert p.observe(gaps, times) == ["d"]
    assert p.observe(gaps, times) == []  # reported once
    even = {"a": 0.5, "b": 0.5, "c": 0.5, "d": 0.5}  # all equally slow: nobody is a straggler
    assert StragglerPolicy(3.0, patience=1).observe(even, {k: 0.1 for k in even}) == []


def test_ranks_keep_model_parallel_groups_together() -> None:
    from service.supervisor import rank_of

    # fsdp only: replica d is rank d
    assert [rank_of(d, 0, 4, 1) for d in range(4)] == [0, 1, 2, 3]
    # fsdp2 x tp2: each replica is a neighbouring tp pair
    assert [[rank_of(d, j, 2, 2) for j in range(2)] for d in range(2)] == [[0, 1], [2, 3]]
    # pp2 x dp2 x tp2 (mesh pp, dp, tp): replica 0 holds 0,1 (stage 0) and 4,5 (stage 1)
    got = [[rank_of(d, j, 2, 2) for j in range(4)] for d in range(2)]
    assert got == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert sorted(r for row in got for r in row) == list(range(8))
