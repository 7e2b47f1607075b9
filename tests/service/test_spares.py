"""Hot spares without Ray: the spec field and its errors, the submit-time checks, the one demand rule
(a job holds its replicas plus its spares) as admission, growth, shrink selection and the autoscaler
apply it, and which replicas form a generation (the others stay out as spares, on other nodes)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service import sizing
from service.scheduling.admission import QuotaPolicy
from service.scheduling.autoscaler import queued_demand
from service.scheduling.policies import plan, select_shrinks
from service.scheduling.snapshot import JobView, Snapshot
from service.spec import MAX_SPARES, SpecError, parse_spec
from service.store import JobStore
from service.submission import SubmissionRefused, submit
from service.supervisor.pool import Replica, ReplicaState, Slot, choose_members
from service.validation import job_problems

TINY: dict[str, Any] = {"model": {"preset": "tiny"}, "training": {"steps": 2, "seq_len": 32, "global_batch_size": 8}}
CPU = {"CPU": 1.0}


def spec(**resources: Any) -> Any:
    return parse_spec({**TINY, "parallelism": {"dp_shard": 4}, "resources": resources})


# ----------------------------------------------------------------------------- the spec
def test_spares_default_to_none_and_take_a_count() -> None:
    assert spec().resources.spares == 0
    assert spec(spares=2).resources.spares == 2


@pytest.mark.parametrize(("value", "words"), [(-1, "negative"), (MAX_SPARES + 1, f"at most {MAX_SPARES}"),
                                              ("two", "valid integer")])
def test_bad_spares_name_the_field_and_the_fix(value: Any, words: str) -> None:
    with pytest.raises(SpecError) as e:
        spec(spares=value)
    line = str(e.value)
    assert line.startswith("resources.spares:") and words in line, line


def test_spares_need_a_bounded_dp() -> None:
    """A job that grows to fill the cluster leaves nothing for spares: refused, naming the way out."""
    s = parse_spec({**TINY, "parallelism": {"dp_shard": -1}, "resources": {"spares": 1}})
    problems = dict(job_problems(s, {"CPU": 8.0}))
    assert "resources.dp.max" in problems["resources.spares"], problems
    bounded = parse_spec({**TINY, "parallelism": {"dp_shard": -1}, "resources": {"spares": 1, "dp": {"max": 4}}})
    assert job_problems(bounded, {"CPU": 8.0}) == []
    assert job_problems(parse_spec({**TINY, "parallelism": {"dp_shard": -1}}), {"CPU": 8.0}) == []


def test_spares_that_do_not_fit_the_cluster_are_the_field_to_fix() -> None:
    # dp.min 2 fits 3 CPUs; with 2 spares (2 more workers) it needs 4.
    problems = job_problems(spec(spares=2, dp={"min": 2}), {"CPU": 3.0})
    assert [f for f, _ in problems] == ["resources.spares"], problems
    assert "lower resources.spares" in problems[0][1] and "needs 4 CPU" in problems[0][1]
    # The gang alone does not fit: the per-worker ask is named, as without spares.
    problems = job_problems(spec(spares=1, dp={"min": 4}), {"CPU": 3.0})
    assert [f for f, _ in problems] == ["resources.cpus_per_worker"], problems
    assert job_problems(spec(spares=1, dp={"min": 2}), {"CPU": 3.0}) == []


def test_gang_demand_counts_the_spares() -> None:
    assert sizing.gang_demand(spec(dp={"min": 2})) == {"CPU": 2.0}
    assert sizing.gang_demand(spec(dp={"min": 2}, spares=1)) == {"CPU": 3.0}
    tp2 = parse_spec({**TINY, "parallelism": {"dp_shard": 2, "tp": 2}, "resources": {"spares": 1, "cpus_per_worker": 0.5}})
    assert sizing.spare_replicas(tp2) == 1
    assert sizing.gang_demand(tp2) == {"CPU": 2.0}  # (dp.min 1 + 1 spare) x tp 2 workers x 0.5 CPU
    assert sizing.gang_demand(tp2, 2) == {"CPU": 1.0}  # an explicit count is taken as it is


@pytest.fixture
def store(tmp_path: Path) -> Iterator[JobStore]:
    s = JobStore(f"sqlite:///{tmp_path / 'jobs.db'}")
    yield s
    s.close()


def test_submit_refuses_bad_spares_and_stores_none(store: JobStore) -> None:
    for resources, total in [({"spares": -2}, {"CPU": 8.0}), ({"spares": 3, "dp": {"min": 2}}, {"CPU": 4.0})]:
        with pytest.raises(SubmissionRefused) as e:
            submit(store, None, {**TINY, "parallelism": {"dp_shard": 4}, "resources": resources}, "alice",
                   cluster_total=total)
        assert "resources.spares" in [f for f, _ in e.value.problems], e.value.problems
    assert store.list_jobs(owner=None)[0] == []
    done = submit(store, None, {**TINY, "parallelism": {"dp_shard": 4}, "resources": {"spares": 1}}, "alice",
                  cluster_total={"CPU": 8.0})
    assert done.job.spec["resources"]["spares"] == 1


# ----------------------------------------------------------------------------- the demand rule
def running(id: str, dp: int, *, spares: int = 0, lo: int = 1, hi: int | None = None, prio: int = 0) -> JobView:
    return JobView(id, "u", prio, 0, CPU, 1, lo, hi if hi is not None else dp, dp=dp, target=dp, spares=spares)


def queued(id: str, lo: int, *, spares: int = 0, hi: int | None = None, prio: int = 0, seq: int = 10) -> JobView:
    return JobView(id, "v", prio, seq, CPU, 1, lo, hi if hi is not None else lo, spares=spares)


def test_a_running_jobs_spares_are_held() -> None:
    job = running("a", 3, spares=1)
    assert job.held == 4 and job.gang == 2
    s = Snapshot({"CPU": 4.0}, {"CPU": 0.0}, (job,))
    assert s.usage()["u"].workers == 4


def test_admission_asks_for_the_minimum_gang_plus_the_spares() -> None:
    # 3 CPUs free: a dp.min 2 job fits, the same job with 2 spares does not (and waits, nothing admitted).
    free = {"CPU": 3.0}
    assert plan(Snapshot({"CPU": 3.0}, free, (), (queued("q", 2),))).admit == {"q": 2}
    p = plan(Snapshot({"CPU": 3.0}, free, (), (queued("q", 2, spares=2),)))
    assert p.admit == {} and "q" in p.waiting
    # With 1 spare it fits, starts at dp.min, and growth leaves the spare's CPU alone: 3 = dp 2 + 1 spare.
    p = plan(Snapshot({"CPU": 3.0}, free, (), (queued("q", 2, hi=4, spares=1),)))
    assert p.admit == {"q": 2}


def test_a_second_job_is_not_admitted_into_the_spares_capacity() -> None:
    """4 CPUs: job a runs at dp 3 with 1 spare. Without counting the spare the scheduler would see 1 CPU
    free (total minus dp) and admit b; counted, nothing is free."""
    a = running("a", 3, spares=1)
    held = sum(a.demand(a.held).values())
    free = {"CPU": 4.0 - held}
    assert free == {"CPU": 0.0}
    p = plan(Snapshot({"CPU": 4.0}, free, (a,), (queued("b", 1),)))
    assert p.admit == {} and "b" in p.waiting


def test_growth_keeps_room_for_the_spares_of_a_job_just_admitted() -> None:
    p = plan(Snapshot({"CPU": 6.0}, {"CPU": 6.0}, (), (queued("q", 1, hi=8, spares=2),)))
    assert p.admit == {"q": 4}  # 4 replicas + 2 spares = 6 CPUs


def test_shrinking_for_a_job_with_spares_frees_its_whole_gang() -> None:
    low = running("low", 4, lo=1)
    assert select_shrinks(queued("high", 1, spares=1, prio=10), {"CPU": 0.0}, [low]) == {"low": 2}


def test_the_autoscaler_is_asked_for_the_spares_too() -> None:
    a, q = running("a", 2, spares=1), queued("q", 2, spares=1)
    snap = Snapshot({"CPU": 3.0}, {"CPU": 0.0}, (a,), (q,), quotas=QuotaPolicy())
    p = plan(snap)
    assert "q" in p.waiting
    assert len(queued_demand(snap, p)) == 3 + 3  # a: 2 + 1 spare; q waits for 2 + 1 spare


# ----------------------------------------------------------------------------- who forms the group
def replica(index: int, node: str | None, state: ReplicaState = ReplicaState.READY) -> Replica:
    slot = Slot(f"w{index}", None, index, 0, info={"node_id": node, "node_name": node} if node else None)
    return Replica(index, None, [slot], state)


def indices(reps: list[Replica]) -> list[int]:
    return [r.index for r in reps]


def test_the_group_packs_and_the_spares_stay_on_other_nodes() -> None:
    ready = [replica(0, "head"), replica(1, "b"), replica(2, "head"), replica(3, "head")]
    assert indices(choose_members(ready, 3)) == [0, 2, 3]  # the spare left out is replica 1, on node b
    ready = [replica(0, "a"), replica(1, "b"), replica(2, "b"), replica(3, "c")]
    assert indices(choose_members(ready, 2)) == [1, 2]


def test_a_swap_keeps_the_survivors_and_takes_the_spare() -> None:
    ready = [replica(0, "head"), replica(2, "head"), replica(3, "b"), replica(4, "head")]
    # Replica 1 was lost; 0 and 2 survived; 3 (node b) and 4 (head) are spares: one joins, on the group's node.
    assert indices(choose_members(ready, 3, keep=[0, 1, 2])) == [0, 2, 4]
    # Only the spare away from the group is left: it joins.
    assert indices(choose_members(ready[:3], 3, keep=[0, 1, 2])) == [0, 2, 3]
    # Fewer ready than asked: all of them.
    assert indices(choose_members(ready[:2], 3, keep=[0, 2])) == [0, 2]


def test_unknown_nodes_and_ties_go_by_index() -> None:
    ready = [replica(5, None), replica(3, None), replica(4, None)]
    assert indices(choose_members(ready, 2)) == [3, 4]


def test_at_the_same_dp_survivors_keep_their_positions() -> None:
    """A swap re-forms at the same dp: the survivors keep their data-parallel positions (so their ranks,
    and the shards their own node's keeper holds), the spare takes the lost replica's."""
    from service.supervisor.generations import Generations

    gens = object.__new__(Generations)  # only its record of the last generation's positions is used
    gens._positions = {0: 0, 1: 1, 2: 2}
    swapped = gens._in_place([replica(0, "head"), replica(2, "head"), replica(3, "b")])
    assert indices(swapped) == [0, 3, 2]
    # Another dp (a shrink or a growth): the order given stands.
    assert indices(gens._in_place([replica(0, "head"), replica(2, "head")])) == [0, 2]
    gens._positions = {}
    assert indices(gens._in_place([replica(4, "b"), replica(3, "b")])) == [4, 3]
