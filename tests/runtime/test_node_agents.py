"""Node agents (workers.node_agent) and the supervisor's side of them (service.supervisor.agents):
folding a node's notes into one batch, finding lost ranks, and the scale simulation's smoke run."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.policies import FailureKind, StragglerPolicy
from service.spec import JobSpec
from service.supervisor.agents import AgentTracker
from service.supervisor.committer import SnapshotCommitter
from service.supervisor.context import JobRun
from service.supervisor.detection import FailureDetector
from service.supervisor.pool import Slot
from service.supervisor.recovery_clock import RecoveryTiming
from service.supervisor.reporter import Reporter
from workers.node_agent import NodeAggregator, agent_groups, process_state
from workers.protocol import CheckpointReport, Heartbeat, NodeBatch, RankLost, SnapshotAck, StepReport


def _run(tmp_path: Path) -> tuple[JobRun, Reporter, SnapshotCommitter]:
    spec = JobSpec.model_validate({"name": "agents"})
    run = JobRun(job_id="j", spec=spec, namespace="t", store=None, restarted=False, self_handle=None, mp=1, cp_tp=1,
                 per_worker={"CPU": 1.0}, dp_min=1, dp_max=16, output_dir=tmp_path)
    run.generation = 2
    reporter = Reporter(run, None)
    return run, reporter, SnapshotCommitter(run, reporter)


def _hb(w: str, rank: int, step: int, gen: int = 2, gap: float = 0.01) -> Heartbeat:
    return Heartbeat(w, gen, rank, 0.0, phase="training", step=step, pid=1, last=StepReport(step, gap, 1.0, 2.0))


def test_a_node_batch_carries_its_ranks_and_the_supervisor_takes_it_whole(tmp_path: Path) -> None:
    run, reporter, committer = _run(tmp_path)
    relayed: list[object] = []
    tracker = AgentTracker(run, committer.on_ack, relayed.append)
    agg = NodeAggregator("job-j/agent-a", "a", heartbeat_timeout_s=5.0)
    for r in range(4):
        agg.own(f"w{r}", r, 2, None, now=0.0)
    for r in range(4):
        ack = SnapshotAck(f"w{r}", 2, r, 1.0, step=7, ok=True, world_size=8, acked=["a", "b"])
        if r % 2:  # on its own, or (as workers send them) riding on the rank's heartbeat
            agg.collect(_hb(f"w{r}", r, 7), now=1.0)
            agg.collect(ack, now=1.0)
        else:
            agg.collect(dataclasses.replace(_hb(f"w{r}", r, 7), acks=[ack]), now=1.0)
    agg.collect(_hb("w0", 0, 6, gen=1), now=1.0)  # an older generation's step: dropped
    ckpt = CheckpointReport("w0", 2, 0, 1.0, step=7, ok=True, uri="file:///x", error=None, abandoned=False)
    agg.collect(ckpt, now=1.0)
    batch = agg.flush(now=1.1)
    assert isinstance(batch, NodeBatch) and batch.node == "a" and batch.seq == 1
    assert set(batch.steps) == {7} and set(batch.steps[7]) == {"w0", "w1", "w2", "w3"}
    assert batch.acks == {(2, 7): [0, 1, 2, 3]} and batch.ack_world == {(2, 7): 8}
    assert batch.notes == [ckpt] and batch.lost == []
    later = agg.flush(now=1.15)  # sent after `batch`, run before it (a threaded actor's order)
    with run.lock:
        tracker.on_batch(later, now=1.2)
        tracker.on_batch(batch, now=1.2)  # still taken: it carries acks and timings of its own
    assert set(run.step_reports[7]["gap"]) == {"w0", "w1", "w2", "w3"}
    assert committer._acks[(2, 7)]["ranks"] == {0, 1, 2, 3}
    assert relayed == [ckpt] and tracker.max_step == 7 and tracker.seen["a"] == 1.2
    assert later.steps == {} and agg.flush(now=2.0).steps == {}  # what was sent is not sent again


def test_the_agent_finds_a_dead_and_a_silent_rank_and_the_detector_names_them(tmp_path: Path) -> None:
    run, reporter, committer = _run(tmp_path)
    tracker = AgentTracker(run, committer.on_ack, lambda n: None, interval_s=0.25, misses=3)
    detector = FailureDetector(run, reporter, StragglerPolicy(3.0))
    slots = [Slot(f"w{r}", None, r, 0, info={"node_name": "a" if r < 2 else "b"}, rank=r) for r in range(4)]
    agg = NodeAggregator("job-j/agent-a", "a", heartbeat_timeout_s=2.0)
    agg.own("w0", 0, 2, None, now=0.0)
    agg.own("w1", 1, 2, None, now=0.0)
    tracker.expect(["a", "b"], now=0.0)
    assert not agg.check(1.0, lambda r: "alive") and not agg.urgent
    assert agg.check(1.5, lambda r: "gone" if r.worker == "w1" else "alive") and agg.urgent
    with run.lock:
        tracker.on_batch(agg.flush(1.5), now=1.5)
    f = detector.from_agents(tracker.take_lost(), tracker.silent(1.5), slots, 1.5)
    assert f is not None and f.kind == FailureKind.WORKER_DIED and [s.name for s in f.slots] == ["w1"]
    assert f.t_fault == 1.0  # when it died is not known: it was alive at the look before (an upper bound)
    assert not agg.check(1.6, lambda r: "gone" if r.worker == "w1" else "alive")  # said once
    agg.collect(_hb("w0", 0, 3), now=1.0)
    assert agg.check(3.5, lambda r: "alive")  # w0 silent for 2.5 s > 2 s
    with run.lock:
        tracker.on_batch(agg.flush(3.5), now=3.5)
    f = detector.from_agents(tracker.take_lost(), [], slots, 3.5)
    assert f is not None and f.kind == FailureKind.HANG and f.slots[0].name == "w0" and f.t_fault == 1.0
    # Node b's agent sent nothing since 0.0: after 3 missed intervals (0.75 s) its node is lost.
    silent = tracker.silent(3.5)
    assert silent == [("b", 0.0)]
    f = detector.from_agents([], silent, slots, 3.5)
    assert f is not None and f.kind == FailureKind.NODE_DIED and {s.name for s in f.slots} == {"w2", "w3"}


def test_a_group_leader_folds_its_members_and_reports_a_silent_member_node(tmp_path: Path) -> None:
    run, reporter, committer = _run(tmp_path)
    tracker = AgentTracker(run, committer.on_ack, lambda n: None, interval_s=0.25, misses=3)
    detector = FailureDetector(run, reporter, StragglerPolicy(3.0))
    groups = agent_groups([f"n{i}" for i in range(5)], fanin=2)
    assert groups == {"n0": ["n0", "n1"], "n2": ["n2", "n3"], "n4": ["n4"]}
    slots = [Slot(f"w{r}", None, r, 0, info={"node_name": f"n{r // 2}"}, rank=r) for r in range(6)]
    aggs = {n: NodeAggregator(f"job-j/agent-{n}", n, 5.0) for n in ("n0", "n1", "n2")}
    for s in slots:
        aggs[s.info["node_name"]].own(s.name, s.rank, 2, None, now=0.0)
    aggs["n0"].lead(["n0", "n1"], now=0.0, timeout_s=0.75)
    tracker.expect(["n0", "n1", "n2"], now=0.0, reporters=["n0", "n2"])
    for s in slots:
        aggs[s.info["node_name"]].collect(_hb(s.name, s.rank, 4), now=0.2)
    assert not aggs["n0"].collect(aggs["n1"].flush(0.25), now=0.26)  # the member's batch, folded
    batch = aggs["n0"].flush(0.3)
    assert set(batch.steps[4]) == {"w0", "w1", "w2", "w3"} and set(batch.members) == {"n0", "n1"}
    with run.lock:
        tracker.on_batch(batch, now=0.3)
        tracker.on_batch(aggs["n2"].flush(0.3), now=0.3)
    assert set(run.step_reports[4]["gap"]) == {"w0", "w1", "w2", "w3", "w4", "w5"}
    assert tracker.silent(0.9) == []  # n1 is a member: its leader watches it, not the supervisor
    assert aggs["n0"].check(1.1, lambda r: "alive") and aggs["n0"].urgent  # n1 silent since 0.26
    with run.lock:
        tracker.on_batch(aggs["n2"].flush(1.0), now=1.0)
        tracker.on_batch(aggs["n0"].flush(1.1), now=1.1)
    silent = tracker.silent(1.1)
    assert silent == [("n1", 0.26)]
    f = detector.from_agents([], silent, slots, 1.1)
    assert f is not None and f.kind == FailureKind.NODE_DIED and {s.name for s in f.slots} == {"w2", "w3"}
    # A leader gone silent: the supervisor finds it itself (n2 sent last at 1.0).
    assert ("n2", 1.0) in tracker.silent(1.8) and ("n2", 1.0) not in tracker.silent(1.7)


def test_a_silent_node_is_written_off_only_when_confirmed_and_a_false_alarm_buys_patience(tmp_path: Path) -> None:
    """Under load a healthy agent can be silent for seconds: silence makes a suspect; Ray's node table,
    a failed ping or the (adaptive) patience writes it off; an answer clears it and raises the patience."""
    run, reporter, committer = _run(tmp_path)
    events: list[tuple[str, dict[str, Any]]] = []
    tracker = AgentTracker(run, committer.on_ack, lambda n: None, event=lambda kind, msg, **data: events.append(
        (kind, data)), interval_s=0.25, misses=3)
    detector = FailureDetector(run, reporter, StragglerPolicy(3.0))
    slots = [Slot(f"w{r}", None, r, 0, info={"node_name": f"n{r}"}, rank=r) for r in range(4)]
    aggs = {f"n{r}": NodeAggregator(f"job-j/agent-n{r}", f"n{r}", 5.0) for r in range(4)}
    tracker.expect(list(aggs), now=0.0)
    for t in (0.25, 0.5):
        with run.lock:
            for a in aggs.values():
                tracker.on_batch(a.flush(t), now=t)
    base = tracker.patience.limit(0.5)
    assert base == 1.0  # the floor: batches came every 0.25 s, 3x that is less
    # n1 falls silent after 0.5: a suspect at 1.5, not lost while its ping is pending within the patience.
    with run.lock:
        for n in ("n0", "n2", "n3"):
            tracker.on_batch(aggs[n].flush(1.5), now=1.5)
    silent = tracker.silent(1.5)
    assert silent == [("n1", 0.5)]
    assert tracker.judge(silent, 1.5, {"n1": "pending"}, set()) == []
    assert tracker.judge(silent, 1.5 + 0.9 * base, {"n1": "pending"}, set()) == []
    # It answers: slow, not lost. Heard from now; the patience grows with the silence it had.
    t = 1.5 + 0.9 * base
    assert tracker.judge(silent, t, {"n1": "answered"}, set()) == []
    with run.lock:
        for n in ("n0", "n2", "n3"):
            tracker.on_batch(aggs[n].flush(t), now=t)
    assert tracker.silent(t) == [] and tracker.false_alarms == 1 and not tracker.suspects
    assert tracker.patience.limit(t) >= 3 * (t - 0.5) > base
    assert [k for k, _ in events] == ["agent_answered"] and events[0][1]["node"] == "n1"
    # Silent again: the larger patience holds it longer, then it is written off.
    with run.lock:
        for n in ("n0", "n2", "n3"):
            tracker.on_batch(aggs[n].flush(t + 1.0), now=t + 1.0)
    found = t + 1.0
    silent = tracker.silent(found)
    assert silent == [("n1", t)]
    assert tracker.judge(silent, found, {"n1": "pending"}, set()) == []
    patience = tracker.patience.limit(found + base)
    assert tracker.judge(silent, found + base + 0.1, {"n1": "pending"}, set()) == []  # the old patience has passed
    lost = tracker.judge(silent, found + patience + 0.1, {"n1": "pending"}, set())
    assert lost == [("n1", t)]
    assert events[-1][0] == "agent_lost" and "did not answer a ping" in events[-1][1]["reason"]
    f = detector.from_agents([], lost, slots, found + patience + 0.1)
    assert f is not None and f.kind == FailureKind.NODE_DIED and [s.name for s in f.slots] == ["w1"]
    # Ray's word, or a ping that fails, is enough at once.
    now = found + patience + 1.0
    silent = [("n2", now - 1.0), ("n3", now - 1.0)]
    assert tracker.judge(silent, now, {"n2": "pending", "n3": "died"}, {"n2"}) == silent
    assert [e[1]["reason"] for e in events[-2:]] == [
        "the node is gone (Ray's node table says so, or its raylet refuses connections)",
        "its agent is gone (Ray says the actor died)"]
    # A ping answered just before its node went does not outweigh Ray's node table (nor raise the patience).
    alarms, now = tracker.false_alarms, now + 1.0
    silent = [("n0", now - 0.5)]
    assert tracker.judge(silent, now, {"n0": "answered"}, {"n0"}) == silent
    assert tracker.false_alarms == alarms and events[-1][0] == "agent_lost"


def test_a_death_ray_told_of_first_takes_its_time_from_the_agents_later_word(tmp_path: Path) -> None:
    """Ray's word of a death carries no time, so a recovery it started has no detection to count. The
    agent's word comes in the next generation's watch: the time it last saw the process alive becomes the
    recovery's fault time (never later than its detection). Words of other workers, other generations,
    or hangs change nothing, and the first word stands."""
    run, reporter, _ = _run(tmp_path)  # generation 2: the recovery's
    detector = FailureDetector(run, reporter, StragglerPolicy(3.0))
    reporter.recoveries.begin(RecoveryTiming(kind="worker_died", cause="the loss of rank 1", t_fault=None,
                                             t_detect=10.0, t_launch=10.1, last_step=5, generation=2,
                                             failed=("w1",), failed_generation=1))
    slots = [Slot(f"w{r}", None, r, 0, info={"node_name": "a"}, rank=r) for r in (0, 2)]
    others = [RankLost("w2", 2, 1, "died", "", 9.0, 10.2), RankLost("w1", 1, 0, "died", "", 8.0, 10.2),
              RankLost("w1", 1, 1, "stopped", "", 9.5, 10.2)]
    assert detector.from_agents(others, [], slots, 10.2) is None
    assert reporter.recoveries.current is not None and reporter.recoveries.current.t_fault is None
    assert detector.from_agents([RankLost("w1", 1, 1, "died", "", 9.93, 10.25)], [], slots, 10.25) is None
    assert reporter.recoveries.current.t_fault == 9.93
    reporter.recoveries.fault_seen("w1", 1, 9.5)
    assert reporter.recoveries.current.t_fault == 9.93
    # Never later than Ray's word (two processes' clocks, a few ms apart): a detection of 0, not below.
    reporter.recoveries.begin(dataclasses.replace(reporter.recoveries.current, t_fault=None))
    reporter.recoveries.fault_seen("w1", 1, 10.05)
    assert reporter.recoveries.current.t_fault == 10.0


def test_a_leader_gives_a_slow_member_back_its_watch_and_more_patience() -> None:
    lead = NodeAggregator("job-j/agent-a", "a", 5.0)
    member = NodeAggregator("job-j/agent-m", "m", 5.0)
    lead.lead(["a", "m"], now=0.0, timeout_s=0.75)
    for t in (0.25, 0.5):
        lead.collect(member.flush(t), now=t)
    assert not lead.check(1.2, lambda r: "alive")  # 0.7 s silent: within 3 intervals
    assert lead.check(1.3, lambda r: "alive")  # 0.8 s: said lost (a suspect for the supervisor)
    assert lead.flush(1.3).lost_nodes == {"m": 0.5}
    assert not lead.check(1.5, lambda r: "alive") and lead.flush(1.5).lost_nodes == {}  # said once
    lead.collect(member.flush(1.6), now=1.6)  # it was slow: watched again, with more patience
    assert "m" in lead.members and lead.member_patience.limit(1.6) >= 3 * 1.1
    limit = lead.member_patience.limit(1.6 + 3.0)
    assert not lead.check(1.6 + 3.0, lambda r: "alive")  # a 3 s silence no longer counts
    assert lead.check(1.6 + limit + 0.1, lambda r: "alive") and lead.flush(5.0).lost_nodes == {"m": 1.6}


def test_a_batch_goes_at_once_when_a_snapshots_acks_are_all_in() -> None:
    """Acks make a batch urgent the moment every rank an agent answers for has acked (a leader: its group's),
    once per snapshot; the commit waits on no interval."""
    lead = NodeAggregator("job-j/agent-a", "a", 5.0)
    member = NodeAggregator("job-j/agent-m", "m", 5.0)
    for r in range(4):
        (lead if r < 2 else member).own(f"w{r}", r, 2, None, now=0.0)
    lead.lead(["a", "m"], now=0.0, timeout_s=0.75)

    def ack(r: int, step: int, ok: bool = True) -> SnapshotAck:
        return SnapshotAck(f"w{r}", 2, r, 1.0, step=step, ok=ok, world_size=4, acked=["a", "m"])

    # Step 5: the member's two ranks (acks on their heartbeats); its second ack makes its batch urgent.
    assert not member.collect(dataclasses.replace(_hb("w2", 2, 6), acks=[ack(2, 5)]), now=1.0)
    assert member.collect(dataclasses.replace(_hb("w3", 3, 6), acks=[ack(3, 5)]), now=1.0)
    batch = member.flush(1.0)
    assert batch.ranks == 2 and batch.acks == {(2, 5): [2, 3]}
    # The leader does not know the member's count before its first batch: no early send.
    assert not lead.collect(ack(0, 5), now=1.0) and not lead.collect(ack(1, 5), now=1.0)
    assert lead.answers_for() is None
    assert lead.collect(batch, now=1.01)  # now it does, and all four are in
    assert lead.answers_for() == 4 and lead.flush(1.01).ranks == 4
    # Step 6: the member's acks first (a failed one among them), then the leader's own two.
    assert not member.collect(ack(2, 6), now=2.0)
    assert member.collect(ack(3, 6, ok=False), now=2.0)  # a failure is an answer too
    assert not lead.collect(member.flush(2.0), now=2.0)
    assert not lead.collect(ack(0, 6), now=2.0)
    assert lead.collect(ack(1, 6), now=2.0)
    assert not lead.collect(ack(1, 6), now=2.0)  # once per snapshot
    # A lost rank is not waited for.
    assert member.check(2.5, lambda r: "gone" if r.worker == "w3" else "alive")
    assert member.collect(ack(2, 7), now=2.5) and member.flush(2.5).ranks == 1
    # An older generation's acks never make a batch urgent.
    assert not member.collect(SnapshotAck("w2", 1, 2, 1.0, step=8, ok=True, world_size=4), now=2.6)


def test_process_state_reads_exit_and_sigstop_from_proc() -> None:
    if not Path("/proc/self/stat").exists():
        pytest.skip("no /proc here")
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert process_state(p.pid) == "alive"
        os.kill(p.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while process_state(p.pid) != "stopped" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_state(p.pid) == "stopped"
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
        assert process_state(p.pid) == "gone"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        NodeAggregator("x", "a", heartbeat_timeout_s=0)


def test_the_scale_simulation_runs_at_64_ranks_and_finds_every_fault_as_what_it_is() -> None:
    from tests.benchmarks.scale_sim import RAY_NODE_S, Params, simulate

    r = simulate(Params(64, trials={"death": 2, "node_loss": 2, "hang": 1, "straggler": 1}, gap_s=0.5))
    assert r["wrong"] == []
    for kind in ("death", "node_loss", "hang", "straggler"):
        assert r[kind]["n"] == {"death": 2, "node_loss": 2}.get(kind, 1)
    # A node loss was found by its agent's silence, before Ray's health check would report it.
    assert r["node_loss"]["p99"] < RAY_NODE_S
    assert r["msgs_per_s"] > 0 and r["steps"] > 0


@pytest.fixture(scope="module")
def bc_cluster() -> Iterator[Any]:
    """The head runs no workers; nodes b and c hold two 0.5-CPU workers each (one agent group, led by b)."""
    from tests.runtime.conftest import make_cluster

    yield from make_cluster(0, {"b": 1, "c": 1})


def test_a_sync_passes_a_leader_whose_node_is_gone(bc_cluster: Any, tmp_path: Path) -> None:
    """A rank's last notes before its run returns (NodeAgent.sync) go through its group's leader; with the
    leader's node lost (as when a node dies while the ranks pause to grow) they go to the supervisor
    straight away, not after Ray calls the leader dead. Node agents on c (member) and on a new node d
    (its leader) report to the supervisor's real receiving parts (AgentTracker, SnapshotCommitter),
    hosted by a small actor."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from checkpointing.nodes import node_ids_by_name
    from workers.node_agent import NodeAgent

    @ray.remote(num_cpus=0)
    class Inbox:
        """The supervisor actor's handling of a node batch (Supervisor.report), on its real parts."""

        def __init__(self, tmp: str) -> None:
            self.run, _, self.committer = _run(Path(tmp))
            self.tracker = AgentTracker(self.run, self.committer.on_ack, lambda n: None)

        def report(self, note: NodeBatch) -> None:
            with self.run.lock:
                self.tracker.on_batch(note, time.time())

        def acked(self) -> dict[tuple[int, int], list[int]]:
            return {k: sorted(v["ranks"]) for k, v in self.committer._acks.items()}

    agents: dict[str, Any] = {}
    bc_cluster.add_node("d", num_cpus=1)
    try:
        ids = node_ids_by_name()
        inbox = Inbox.options(  # (a 0-CPU actor may land on any node: not on d, which is killed)
            scheduling_strategy=NodeAffinitySchedulingStrategy(ids["head"], soft=False)).remote(str(tmp_path))
        agents.update({n: ray.remote(NodeAgent).options(
            num_cpus=0, max_concurrency=16, scheduling_strategy=NodeAffinitySchedulingStrategy(ids[n], soft=False),
        ).remote(f"job-j/agent-{n}", n, inbox, 30.0, 5.0) for n in ("c", "d")})  # no batch but the syncs'
        ray.get([agents["d"].set_upstream.remote(None, ["c"], 5.0),
                 agents["c"].set_upstream.remote(agents["d"], [], 5.0, "d"),
                 agents["c"].own.remote([(f"w{r}", r, 2, os.getpid(), None) for r in (0, 1)])], timeout=60)

        def ack(step: int) -> SnapshotAck:  # rank 0's; rank 1's never comes, so no batch leaves early
            return SnapshotAck("w0", 2, 0, time.time(), step=step, ok=True, world_size=2, acked=["c"])

        ray.get(agents["c"].report.remote(ack(7)), timeout=30)
        ray.get(agents["c"].sync.remote(), timeout=60)  # through the live leader
        assert ray.get(inbox.acked.remote(), timeout=30) == {(2, 7): [0]}
        bc_cluster.kill_node("d")
        ray.get(agents["c"].report.remote(ack(8)), timeout=30)
        ray.get(agents["c"].sync.remote(), timeout=60)  # the leader is gone: straight to the supervisor
        assert ray.get(inbox.acked.remote(), timeout=30) == {(2, 7): [0], (2, 8): [0]}
    finally:
        if "d" in bc_cluster.nodes:
            bc_cluster.kill_node("d")
        for a in agents.values():
            with contextlib.suppress(Exception):
                ray.kill(a)


def test_a_hung_node_is_found_by_its_group_leaders_agent(bc_cluster: Any, tmp_path: Path) -> None:
    import ray

    from tests.runtime.jobs import JobRun, assert_no_leaks, paced, tiny_spec

    slow = paced(4, 0.3)
    run = JobRun(tiny_spec(tmp_path, steps=40, chaos=slow))
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            run.poll()
            st = ray.get(run.handle.status.remote(), timeout=30)
            if st["step"] >= 3:
                break
            time.sleep(0.3)
        gen0 = run.of("generation")[0]["data"]
        assert gen0["world_size"] == 4 and gen0["agents"] == ["b", "c"], gen0
        # Node c hangs (every process on it stopped: a partition looks the same). Its raylet's port still
        # takes connections, so only silence tells: c is a member of b's group, and b's agent sees it fall
        # silent. (A node whose processes are gone is found sooner: its raylet refuses connections.)
        frozen_at = time.time()
        bc_cluster.freeze_node("c")
        run.wait(timeout_s=400)
        assert run.status["state"] == "SUCCEEDED", (run.status.get("reason"),
                                                    [(e["kind"], e["message"][:200]) for e in run.events][-15:])
        silent = run.of("agent_silent")  # b's agent saw c fall silent (then the supervisor confirms, or
        # Ray's report of the dead workers ends the generation first)
        assert silent and silent[0]["data"]["node"] == "c" and silent[0]["data"]["leader"] == "b", run.kinds()
        # Nothing alive was suspected once c froze: b's agent, which leads c, must not fall silent over c.
        # (Before the freeze, a start-up on a busy machine may keep an agent silent past its 1 s patience;
        # the ping's answer then clears it, as it should: a slow node is not a lost one.)
        late = [e for e in run.of("agent_answered") if e["ts"] >= frozen_at]
        assert not late, late
        # The recovery starts from whichever report comes first: Ray's of the node's dead workers (often
        # before the node is marked dead: worker_died), the agents', or a broken collective.
        first = run.of("failure_detected")[0]["data"]
        assert first["kind"] in ("node_died", "worker_died", "collective_error"), first
        # Both of c's ranks are written off: at once (the agents' report), or one by one as Ray reports them.
        resizes = [(e["data"]["old_dp"], e["data"]["new_dp"]) for e in run.of("resized")]
        assert resizes in ([(4, 2)], [(4, 3), (3, 2)]), resizes
        assert run.of("generation")[-1]["data"]["agents"] == ["b"]
    finally:
        run.finish()
        if "c" in bc_cluster.nodes:
            bc_cluster.kill_node("c")
    assert_no_leaks(run.job_id)
