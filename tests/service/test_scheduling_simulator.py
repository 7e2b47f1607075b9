"""The scheduling SIMULATION (service.scheduling.simulator): deterministic for a seed, and the relations
its three policy families must show on a trace where urgent jobs arrive on a busy cluster."""

from __future__ import annotations

import pytest

from service.scheduling.simulator import HIGH, Costs, make_trace, simulate


def test_a_seed_gives_the_same_trace_and_results() -> None:
    a, b = make_trace(7), make_trace(7)
    assert a == b and a != make_trace(8)
    assert len(a) >= 50 and all(1 <= j.dp_min <= j.dp_max for j in a)
    assert any(j.priority == HIGH for j in a) and any(j.dp_max > j.dp_min for j in a)
    assert simulate(a, "shrink").row() == simulate(b, "shrink").row()


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    trace = make_trace(1)
    return {m: simulate(trace, m) for m in ("fifo", "kill", "shrink")}


def test_every_job_finishes_no_faster_than_its_work_allows(results: dict) -> None:
    trace = make_trace(1)
    costs = Costs()
    floor = sorted(j.work / j.dp_max + costs.start_s for j in trace)
    for r in results.values():
        assert len(r.jct) == len(trace)
        assert sorted(r.jct)[0] >= floor[0] - 1e-6
        assert 0.0 < r.utilisation <= 1.0


def test_the_policies_relate_as_they_must(results: dict) -> None:
    fifo, kill, shrink = results["fifo"].row(), results["kill"].row(), results["shrink"].row()
    # Only kill-based preemption stops jobs and throws work away.
    assert fifo["preemptions"] == shrink["preemptions"] == 0 and fifo["lost_work"] == shrink["lost_work"] == 0
    assert kill["preemptions"] > 0 and kill["lost_work"] > 0
    # Both preempting policies get urgent jobs in sooner than FIFO gang admission.
    assert shrink["high_wait_mean_s"] < fifo["high_wait_mean_s"]
    assert kill["high_wait_mean_s"] < fifo["high_wait_mean_s"]
    # Shrinking loses no work, so the jobs as a whole finish sooner than when they are killed.
    assert shrink["mean_jct_s"] < kill["mean_jct_s"]


def test_a_bad_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="mode 'lifo' must be one of"):
        simulate(make_trace(1, 3), "lifo")  # type: ignore[arg-type]
