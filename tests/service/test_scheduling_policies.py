"""The elastic scheduling policies (service.scheduling.policies) on real snapshots: shrink selection
(least disruptive, never below dp.min, never a non-elastic or higher-priority job, nothing shrunk for
nothing), growth (priority, then weighted fair share, within quotas), and one plan pass per mode. The
shrink selection is also checked against a brute-force search of every shrink vector on random
clusters."""

from __future__ import annotations

import itertools
import random

import pytest

from service.scheduling.admission import Quota, QuotaPolicy
from service.scheduling.policies import disruption, plan, plan_growth, select_preemptions, select_shrinks
from service.scheduling.snapshot import JobView, Snapshot, covers

CPU = {"CPU": 1.0}


def run(id: str, dp: int, *, lo: int = 1, hi: int | None = None, prio: int = 0, owner: str = "u", seq: int = 0,
        target: int | None = None, replica: dict[str, float] | None = None) -> JobView:
    return JobView(id, owner, prio, seq, replica or CPU, 1, lo, hi if hi is not None else dp, dp=dp,
                   target=dp if target is None else target)


def queued(id: str, lo: int, *, hi: int | None = None, prio: int = 10, owner: str = "v", seq: int = 100,
           replica: dict[str, float] | None = None) -> JobView:
    return JobView(id, owner, prio, seq, replica or CPU, 1, lo, hi if hi is not None else lo)


# ----------------------------------------------------------------------------- shrink selection
def test_a_low_priority_job_shrinks_just_enough() -> None:
    assert select_shrinks(queued("high", 2), {"CPU": 0.0}, [run("low", 4, lo=2)]) == {"low": 2}
    assert select_shrinks(queued("high", 1), {"CPU": 0.0}, [run("low", 4, lo=1)]) == {"low": 3}
    assert select_shrinks(queued("high", 2), {"CPU": 1.0}, [run("low", 4, lo=1)]) == {"low": 3}


def test_it_fits_already_so_nothing_shrinks() -> None:
    assert select_shrinks(queued("high", 2), {"CPU": 2.0}, [run("low", 4)]) == {}


def test_never_below_dp_min_and_nothing_for_nothing() -> None:
    # low can give 1 (4 -> 3), the queued job needs 2: nothing shrinks at all.
    assert select_shrinks(queued("high", 2), {"CPU": 0.0}, [run("low", 4, lo=3)]) is None
    s = Snapshot({"CPU": 4.0}, {"CPU": 0.0}, (run("low", 4, lo=3),), (queued("high", 2),))
    p = plan(s)
    assert p.resizes == [] and p.admit == {}
    assert "high" in p.waiting


def test_non_elastic_and_higher_priority_jobs_are_never_shrunk() -> None:
    fixed = run("fixed", 4, lo=4, prio=0)
    above = run("above", 4, lo=1, prio=20)
    assert select_shrinks(queued("high", 2), {"CPU": 0.0}, [fixed, above]) is None
    assert select_shrinks(queued("high", 2), {"CPU": 0.0}, [fixed, above, run("low", 3, lo=1, prio=5)]) == {"low": 1}


def test_two_low_jobs_only_one_shrinks() -> None:
    a, b = run("a", 4, lo=2, seq=1), run("b", 4, lo=2, seq=2)
    got = select_shrinks(queued("high", 2), {"CPU": 0.0}, [a, b])
    assert got is not None and len(got) == 1 and set(got.values()) == {2}
    # Spreading 1 + 1 over both would touch two jobs: the one-job answer wins even when it takes as many.
    got = select_shrinks(queued("high", 2), {"CPU": 0.0}, [run("a", 3, lo=1, seq=1), run("b", 3, lo=2, seq=2)])
    assert got == {"a": 1}


def test_the_lowest_priority_shrinks_first_then_the_fewest_replicas() -> None:
    jobs = [run("p5", 4, lo=1, prio=5), run("p1", 4, lo=1, prio=1), run("p3", 4, lo=1, prio=3)]
    assert select_shrinks(queued("high", 2), {"CPU": 0.0}, jobs) == {"p1": 2}
    # Fewer jobs before lower priorities: p5 alone rather than p1 and p3 together.
    jobs = [run("p5", 4, lo=1, prio=5), run("p1", 2, lo=1, prio=1), run("p3", 4, lo=2, prio=3)]
    assert select_shrinks(queued("high", 3), {"CPU": 0.0}, jobs) == {"p5": 1}
    # No one job can free 3: of the pairs that can, the one with the lower priorities (p3 + p1, not p5 + p3).
    jobs = [run("p5", 4, lo=3, prio=5), run("p1", 2, lo=1, prio=1), run("p3", 4, lo=2, prio=3)]
    assert select_shrinks(queued("high", 3), {"CPU": 0.0}, jobs) == {"p1": 1, "p3": 2}


def test_equal_priority_gives_back_only_when_lower_cannot() -> None:
    same = run("same", 4, lo=1, prio=10)
    low = run("low", 4, lo=2, prio=0)
    assert select_shrinks(queued("q", 2), {"CPU": 0.0}, [same, low]) == {"low": 2}
    assert select_shrinks(queued("q", 3), {"CPU": 0.0}, [same, low]) == {"low": 2, "same": 3}
    assert select_shrinks(queued("q", 2), {"CPU": 0.0}, [same]) == {"same": 2}


def test_resources_a_job_does_not_hold_do_not_count() -> None:
    gpu = {"CPU": 1.0, "GPU": 1.0}
    cpu_only = run("cpu", 8, lo=1)
    gpu_job = run("gpu", 4, lo=2, replica=gpu, seq=5)
    got = select_shrinks(queued("g", 2, replica=gpu), {"CPU": 10.0, "GPU": 0.0}, [cpu_only, gpu_job])
    assert got == {"gpu": 2}


def test_a_shrink_under_way_is_waited_for_not_repeated() -> None:
    shrinking = run("low", 4, lo=2, target=2)  # asked 4 -> 2, still at 4
    s = Snapshot({"CPU": 4.0}, {"CPU": 0.0}, (shrinking,), (queued("high", 2),))
    p = plan(s)
    assert p.resizes == [] and p.admit == {}
    assert "finish shrinking" in p.waiting["high"]


def test_plan_shrinks_then_admits_then_grows_back() -> None:
    high = queued("high", 2)
    p = plan(Snapshot({"CPU": 4.0}, {"CPU": 0.0}, (run("low", 4, lo=2, hi=4),), (high,)))
    assert [(r.job_id, r.old, r.new, r.kind) for r in p.resizes] == [("low", 4, 2, "shrink")]
    assert p.resizes[0].reason == "shrunk 4→2 to admit job high, priority 10"
    p = plan(Snapshot({"CPU": 4.0}, {"CPU": 2.0}, (run("low", 2, lo=2, hi=4),), (high,)))
    assert p.admit == {"high": 2} and p.resizes == []
    p = plan(Snapshot({"CPU": 4.0}, {"CPU": 2.0}, (run("low", 2, lo=2, hi=4),), ()), freed_by="high")
    assert [(r.job_id, r.new, r.reason) for r in p.resizes] == [("low", 4, "grown 2→4: capacity freed by job high")]


# ----------------------------------------------------------------------------- growth
def test_growth_goes_by_priority_first() -> None:
    jobs = [run("lo", 1, hi=4, prio=0, seq=1), run("hi", 1, hi=4, prio=5, seq=2)]
    assert plan_growth({"CPU": 3.0}, jobs, {}) == {"hi": 4}
    assert plan_growth({"CPU": 4.0}, jobs, {}) == {"hi": 4, "lo": 2}


def test_growth_is_fair_share_by_owner_weight() -> None:
    jobs = [run("a", 1, hi=10, owner="alice", seq=1), run("b", 1, hi=10, owner="bob", seq=2)]
    assert plan_growth({"CPU": 4.0}, jobs, {}) == {"a": 3, "b": 3}
    # bob's weight 2: bob ends with twice alice's workers (2 and 4 of 6).
    assert plan_growth({"CPU": 4.0}, jobs, {"bob": 2.0}) == {"a": 2, "b": 4}


def test_growth_keeps_to_dp_max_and_quotas() -> None:
    assert plan_growth({"CPU": 10.0}, [run("a", 1, hi=3)], {}) == {"a": 3}
    quotas = QuotaPolicy(per_owner={"u": Quota(max_workers=2)})
    assert plan_growth({"CPU": 10.0}, [run("a", 1, hi=3)], {}, quotas, None) == {"a": 2}


def test_nothing_grows_while_a_job_waits_for_capacity() -> None:
    s = Snapshot({"CPU": 6.0}, {"CPU": 1.0}, (run("low", 3, lo=3, hi=6), run("other", 2, lo=2, hi=2)),
                 (queued("big", 3, prio=0),))
    p = plan(s)
    assert p.resizes == [] and p.admit == {}


def test_an_admitted_job_starts_as_big_as_free_capacity_allows() -> None:
    p = plan(Snapshot({"CPU": 8.0}, {"CPU": 5.0}, (), (queued("q", 2, hi=4),)))
    assert p.admit == {"q": 4} and p.resizes == []


# ----------------------------------------------------------------------------- modes
def test_kill_mode_preempts_and_fifo_mode_waits() -> None:
    s = Snapshot({"CPU": 4.0}, {"CPU": 0.0}, (run("low", 4, lo=2),), (queued("high", 2),))
    assert plan(s, "kill").preempt == ["low"] and plan(s, "kill").resizes == []
    fifo = plan(s, "fifo")
    assert fifo.preempt == [] and fifo.resizes == [] and fifo.admit == {}
    assert select_preemptions(queued("high", 2), {"CPU": 0.0}, [run("same", 4, prio=10)]) is None
    with pytest.raises(ValueError, match="mode 'lifo' must be one of"):
        plan(s, "lifo")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- brute force
def _brute(need: int, free: int, jobs: list[JobView], prio: int) -> tuple | None:
    """The least disruptive shrink vector by trying every one (one CPU per replica)."""
    cands = [j for j in jobs if j.elastic and j.priority <= prio]
    best = None
    for vec in itertools.product(*[range(0, j.target - j.dp_min + 1) for j in cands]):
        if free + sum(vec) < need:
            continue
        take = {j.id: n for j, n in zip(cands, vec, strict=True) if n}
        subset = [j for j in cands if j.id in take]
        key = disruption(subset, take, prio)
        if best is None or key < best:
            best = key
    return best


@pytest.mark.parametrize("seed", range(300))
def test_shrink_selection_matches_a_brute_force_search(seed: int) -> None:
    rng = random.Random(seed)
    jobs = []
    for i in range(rng.randint(1, 4)):
        dp = rng.randint(1, 5)
        jobs.append(run(f"j{i}", dp, lo=rng.randint(1, dp), hi=dp + rng.randint(0, 2), prio=rng.choice([0, 5, 10, 20]),
                        seq=i))
    need, free = rng.randint(1, 8), rng.randint(0, 2)
    q = queued("q", need, prio=10)
    got = select_shrinks(q, {"CPU": float(free)}, jobs)
    best = _brute(need, free, jobs, 10)
    if need <= free:
        assert got == {}
        return
    if best is None:
        assert got is None
        return
    assert got is not None
    by = {j.id: j for j in jobs}
    for jid, new in got.items():  # feasible: elastic, not above the queued priority, within dp.min
        j = by[jid]
        assert j.elastic and j.priority <= 10 and j.dp_min <= new < j.target
    freed = {"CPU": float(free + sum(by[jid].target - new for jid, new in got.items()))}
    assert covers(freed, q.demand(q.dp_min))
    take = {jid: by[jid].target - new for jid, new in got.items()}
    assert disruption([by[jid] for jid in take], take, 10) == best


# ----------------------------------------------------------------------------- the autoscaler's request
def test_queued_demand_is_the_whole_shape_and_released_once_met() -> None:
    from service.scheduling.autoscaler import queued_demand

    half = {"CPU": 0.5}
    running = run("a", 2, lo=2, replica=half)
    waiting = queued("b", 2, replica=half)
    s = Snapshot({"CPU": 1.0}, {"CPU": 0.0}, (running,), (waiting,))
    # A target shape, not an increment: the running job's workers and the waiting job's minimum gang.
    assert queued_demand(s, plan(s)) == [half] * 4
    started = run("b", 0, lo=2, target=2, replica=half)  # admitted, its workers not placed yet: still held
    s = Snapshot({"CPU": 2.0}, {"CPU": 0.0}, (running, started), ())
    assert queued_demand(s, plan(s)) == [half] * 4
    placed = run("b", 2, lo=2, replica=half)
    s = Snapshot({"CPU": 2.0}, {"CPU": 0.0}, (running, placed), ())
    assert queued_demand(s, plan(s)) == []  # met: released
    over_quota = Snapshot({"CPU": 1.0}, {"CPU": 0.0}, (running,), (waiting,),
                          quotas=QuotaPolicy(per_owner={"v": Quota(max_running_jobs=0)}))
    assert queued_demand(over_quota, plan(over_quota)) == []  # waits for its quota, not for capacity


def test_growth_waits_for_released_workers_only_on_what_jobs_hold() -> None:
    """Growth waits while Ray still counts an ended job's workers; Ray's object store being in use (any
    stored object lowers its available count) is not such a wait, nor is memory."""
    from service.scheduler import still_releasing

    total = {"CPU": 3.0, "memory": 8e9, "object_store_memory": 2e8, "node:127.0.0.1": 1.0}
    reserved = {"CPU": 2.0}  # the running jobs' workers
    in_use = {"CPU": 1.0, "memory": 8e9, "object_store_memory": 1.5e8, "node:127.0.0.1": 1.0}
    assert not still_releasing(in_use, total, reserved)
    assert still_releasing({**in_use, "CPU": 0.5}, total, reserved)  # half a CPU not yet given back
    gpus = {"CPU": 2.0, "GPU": 1.0}
    assert still_releasing({"CPU": 1.0, "GPU": 0.0}, {"CPU": 3.0, "GPU": 2.0}, gpus)
    assert not still_releasing({"CPU": 1.0, "GPU": 1.0}, {"CPU": 3.0, "GPU": 2.0}, gpus)
