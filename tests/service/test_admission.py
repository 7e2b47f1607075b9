"""The scheduler's policy and the job sizing arithmetic, on real specs and real data structures."""

from __future__ import annotations

import pytest

from service import sizing
from service.scheduler import OwnerUsage, QueuedJob, Quota, QuotaPolicy, plan_admission, queued_job
from service.spec import parse_spec
from service.store import JobRecord
from service.validation import job_problems


def job(id: str, workers: int, *, priority: int = 0, seq: int = 0, owner: str = "u", cpus: float = 1.0,
        gpus: float = 0.0) -> QueuedJob:
    demand = {"CPU": workers * cpus} | ({"GPU": workers * gpus} if gpus else {})
    return QueuedJob(id, owner, priority, seq, workers, demand)


CLUSTER = {"CPU": 8.0, "GPU": 2.0}


def test_priority_then_fifo_and_gang_all_or_nothing() -> None:
    q = [job("a", 2, seq=1), job("b", 2, seq=2, priority=5), job("c", 3, seq=3), job("d", 2, seq=4, priority=5)]
    plan = plan_admission(q, {"CPU": 6.0}, CLUSTER, {}, QuotaPolicy())
    # b and d (priority 5, FIFO) take 4 CPUs, a takes 2; c (3 workers) does not fit the 0 left.
    assert plan.admit == ["b", "d", "a"]
    assert "waiting for 3 CPU" in plan.waiting["c"]


def test_a_job_that_does_not_fit_now_blocks_those_behind_it() -> None:
    q = [job("big", 6, seq=1), job("small", 1, seq=2)]
    plan = plan_admission(q, {"CPU": 4.0}, CLUSTER, {}, QuotaPolicy())
    assert plan.admit == []
    assert plan.waiting["small"] == "queued behind job big (priority 0)"
    # ... but a higher-priority small job goes first.
    plan = plan_admission([*q, job("urgent", 1, seq=3, priority=9)], {"CPU": 4.0}, CLUSTER, {}, QuotaPolicy())
    assert plan.admit == ["urgent"]


def test_a_job_larger_than_the_cluster_does_not_block_the_queue() -> None:
    q = [job("huge", 12, seq=1), job("gpu", 1, seq=2, gpus=4), job("ok", 2, seq=3)]
    plan = plan_admission(q, {"CPU": 8.0, "GPU": 2.0}, CLUSTER, {}, QuotaPolicy())
    assert plan.admit == ["ok"]
    assert "whole cluster has 8 CPU" in plan.waiting["huge"]
    assert "whole cluster has" in plan.waiting["gpu"] and "GPU" in plan.waiting["gpu"]


def test_quotas_hold_one_owner_without_blocking_others() -> None:
    quotas = QuotaPolicy(default=Quota(max_running_jobs=2), per_owner={"vip": Quota(max_workers=3)})
    usage = {"alice": OwnerUsage(jobs=2, workers=2)}
    q = [job("a1", 1, seq=1, owner="alice"), job("b1", 1, seq=2, owner="bob"), job("v1", 2, seq=3, owner="vip"),
         job("v2", 2, seq=4, owner="vip"), job("b2", 1, seq=5, owner="bob"), job("b3", 1, seq=6, owner="bob")]
    plan = plan_admission(q, {"CPU": 8.0}, CLUSTER, usage, quotas)
    assert plan.admit == ["b1", "v1", "b2"]
    assert "quota of 2 running jobs" in plan.waiting["a1"]
    assert "quota of 3" in plan.waiting["v2"]  # 2 + 2 workers > 3
    assert "quota of 2 running jobs" in plan.waiting["b3"]  # counted within the same pass
    assert usage["alice"].jobs == 2  # the caller's numbers are not changed


def test_world_size_and_demand_from_specs() -> None:
    s = parse_spec({"parallelism": {"tp": 2, "pp": 2}, "resources": {"dp": {"min": 2, "max": 4},
                                                                     "cpus_per_worker": 0.5, "gpus_per_worker": 1,
                                                                     "custom": {"node_a": 0.1}}})
    assert sizing.job_world_size(s) == (8, 16)
    assert sizing.gang_demand(s) == {"CPU": 4.0, "GPU": 8.0, "node_a": pytest.approx(0.8)}
    assert sizing.max_workers_fitting(sizing.worker_resources(s), {"CPU": 3.0, "GPU": 5.0, "node_a": 1.0}) == 5
    fixed = parse_spec({"parallelism": {"dp_replicate": 2, "dp_shard": 2, "cp": 2}, "resources": {"dp": {"min": 2}}})
    assert sizing.job_world_size(fixed) == (4, 8)
    fill = parse_spec({"resources": {"dp": {"min": 3}}})
    assert sizing.job_world_size(fill) == (3, None)
    rec = JobRecord(id="x", name="n", owner="o", status="PENDING", reason=None, priority=1, spec={}, min_world=8,
                    max_world=16, created_at=0, updated_at=0, admitted_at=None, started_at=None, finished_at=None,
                    cancel_requested=False, recoveries=0, progress=None, seq=7)
    assert queued_job(rec, s) == QueuedJob("x", "o", 1, 7, 8, sizing.gang_demand(s))


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"parallelism": {"tp": 3}}, "parallelism.tp"),
        ({"parallelism": {"pp": 4}, "model": {"n_layers": 2}}, "parallelism.pp"),
        ({"parallelism": {"cp": 3}}, "parallelism.cp"),
        ({"parallelism": {"dp_shard": 2}, "resources": {"dp": {"max": 4}}}, "resources.dp.max"),
        ({"parallelism": {"dp_shard": 2}, "resources": {"dp": {"min": 3}}}, "resources.dp.min"),
        ({"parallelism": {"dp_replicate": 2}, "resources": {"dp": {"min": 3}}}, "resources.dp.min"),
        ({"resources": {"dp": {"min": 9}}}, "resources.cpus_per_worker"),
        ({"resources": {"gpus_per_worker": 1}}, "resources.gpus_per_worker"),
        ({"resources": {"custom": {"tpu": 1}}}, "resources.custom.tpu"),
    ],
)
def test_problems_name_the_field(section: dict, field: str) -> None:
    problems = job_problems(parse_spec(section), {"CPU": 8.0})
    assert field in [f for f, _ in problems], problems
    pure = sizing.layout_problems(parse_spec(section), {"CPU": 8.0})
    assert field in [f for f, _ in pure], pure  # the torch-free checks agree


def test_pip_packages_are_refused_not_ignored() -> None:
    """No job's packages are installed anywhere, so a job naming some is refused with the field and the fix."""
    problems = job_problems(parse_spec({"runtime_env": {"pip": ["einops"]}}), {"CPU": 8.0})
    assert [f for f, _ in problems] == ["runtime_env.pip"], problems
    assert "einops" in problems[0][1] and "remove runtime_env.pip" in problems[0][1]


def test_a_good_spec_has_no_problems() -> None:
    ok = parse_spec({"parallelism": {"tp": 2, "dp_shard": 2}, "resources": {"dp": {"min": 1, "max": 2}}})
    assert job_problems(ok, {"CPU": 8.0}) == [] and sizing.layout_problems(ok, {"CPU": 8.0}) == []
