"""Node loss on a 3-node cluster: the head runs no workers; nodes b and c hold two workers each.

kill_node on rank 0 SIGKILLs its node's raylet (whichever of b, c it is): the job shrinks 4 -> 2;
the node started again under its name lets it grow back to 4 at a snapshot boundary, with the
fault-free losses. That node is lost again as the job pauses to grow onto it: the grow leaves its replica
out (no generation is launched with a dead member), and a third node grows the job back.
Then, with dp.min = 4, a node loss leaves the job below its minimum: it waits, fails with a
clear reason and releases everything. First, a warm spare that shares the lost node with a rank of the
group is dropped with it, never swapped in.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.local_cluster import LocalCluster, stat_fields
from tests.runtime.conftest import make_cluster
from tests.runtime.jobs import JobRun, assert_no_leaks, assert_same_losses, paced, tiny_spec, worker_infos

STEPS = 60
GROW_STEPS = 90  # room for two grows after the loss
SLOW = paced(4, 0.4)  # time to grow


@pytest.fixture(scope="module")
def nodes_cluster() -> Iterator[LocalCluster]:
    yield from make_cluster(0, {"b": 1, "c": 1})


def test_a_spare_lost_with_its_node_is_not_swapped_in(nodes_cluster: LocalCluster, tmp_path: Path) -> None:
    """dp 3 and one warm spare over b and c (two 0.5-CPU workers a node), so the spare shares its node
    with a rank of the group. That node is lost: the spare goes with it (`spare_lost`) and is not swapped
    in; the job shrinks to the two ranks left in one recovery, with no generation formed around a dead
    spare (whose survivors would wait in the rendezvous for it until the collective timeout)."""
    s = tiny_spec(tmp_path, steps=30, dp=3, dp_min=2, chaos=SLOW[:3])
    s = s.model_copy(update={"resources": s.resources.model_copy(update={"spares": 1})})
    run = JobRun(s)
    killed: list[str] = []
    alive: list[int] = []  # the lost node's workers still running right after kill_node returned

    def kill_the_spares_node(ev: dict[str, Any]) -> None:
        if ev["kind"] != "spares" or ev["data"].get("spares") != 1 or killed:
            return
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(run.rows() if (tmp_path / "metrics.jsonl").exists() else []) < 2:
            time.sleep(0.2)  # a snapshot to recover from
        node = ev["data"]["nodes"][0]
        on_node = [i["pid"] for i in worker_infos(run.job_id) if i["node_name"] == node]
        nodes_cluster.kill_node(node)
        killed.append(node)
        # Every process of the node at once, as a machine's loss: also the workers forked by the job's
        # zygote there, which are no children of its raylet (before, they trained on until they noticed).
        alive.extend(p for p in on_node if _running(p))

    try:
        run.wait(timeout_s=400, on_event=kill_the_spares_node)
        assert run.status["state"] == "SUCCEEDED", run.events
        assert killed, run.kinds()
        assert not alive, f"workers of the lost node still running after kill_node: {alive}"
        lost = run.of("spare_lost")
        assert lost and lost[0]["data"]["node"] == killed[0], [e["message"] for e in lost]
        assert not run.of("spare_swapped") and not run.of("recovery_interrupted"), run.kinds()
        gens = [e["data"] for e in run.of("generation")]
        assert [g["dp"] for g in gens[:2]] == [3, 2], gens
        assert killed[0] not in gens[1]["nodes"], gens[1]
        recovered = run.of("recovered")
        # From memory, not from scratch. How many steps it goes back is timing, not a bound: when rank 0 is
        # on the lost node, the rows (and acks) its agent had not yet sent are lost with it, and a restore
        # never skips a step without a row (CI, 2 loaded cores: rows 3-4 lost, restored step 2).
        assert recovered and recovered[0]["data"]["source"] == ["keepers"], recovered
        assert recovered[0]["data"]["restored_step"] >= 1, recovered
        assert [r["step"] for r in run.rows()] == list(range(1, 31))
    finally:
        run.finish()
        nodes_cluster.add_node(f"{killed[0]}2" if killed else "spare", num_cpus=1)  # the next test's shape
    assert_no_leaks(run.job_id)


def test_node_loss_shrinks_then_a_new_node_grows_it_back(nodes_cluster: LocalCluster, tmp_path: Path) -> None:
    ref_run = JobRun(tiny_spec(tmp_path / "ref", steps=GROW_STEPS))
    ref_run.wait()
    ref_run.finish()
    assert ref_run.status["state"] == "SUCCEEDED", ref_run.events
    ref = ref_run.rows()

    chaos = [*SLOW, {"kind": "kill_node", "step": 3, "rank": 0}]
    run = JobRun(tiny_spec(tmp_path / "job", steps=GROW_STEPS, chaos=chaos))
    added: list[str] = []
    gens: list[dict[str, Any]] = []

    def on_event(ev: dict[str, Any]) -> None:
        if ev["kind"] == "generation":
            gens.append(ev["data"])
        if ev["kind"] == "resized" and ev["data"]["new_dp"] == 2 and not added:
            # Capacity returns as the lost node started again under its name (a raylet restarted on its
            # host): a new Ray node, whose agent must be a new one too, not the one lost with the old node.
            (lost,) = set(gens[0]["nodes"]) - set(gens[-1]["nodes"])
            nodes_cluster.kill_node(lost)  # (its raylet is dead already: this reaps what is left)
            nodes_cluster.add_node(lost, num_cpus=1)
            added.append(lost)
        if ev["kind"] == "growing" and ev["data"]["target_dp"] == 4 and len(added) == 1:
            # Lost again as the group pauses to grow onto it (the pause ends two steps on), then a third
            # node brings the capacity back.
            nodes_cluster.kill_node(added[0])
            added.append(f"{added[0]}x")
            nodes_cluster.add_node(added[1], num_cpus=1)

    try:
        run.wait(timeout_s=600, on_event=on_event)
        assert run.status["state"] == "SUCCEEDED", run.events
        first = run.of("failure_detected")[0]["data"]
        assert first["kind"] in ("node_died", "worker_died", "collective_error"), first
        resizes = [(e["data"]["old_dp"], e["data"]["new_dp"]) for e in run.of("resized")]
        # Shrink to the two workers left, then grow back to 4 (in one step or as replicas get ready).
        assert resizes[0] == (4, 2) and resizes[-1][1] == 4, resizes
        assert all(e["data"]["cause"] == "growth" for e in run.of("resized")[1:]), [e["message"] for e in run.of("resized")]
        # The node lost as the job paused to grow onto it: its replica is dropped before the launch, so the
        # next generation forms at dp 2 without it, and nothing fails (before, a generation was launched
        # with the dead replica, and failed at once: a second recovery).
        assert len(added) == 2, [e["message"] for e in run.events[-12:]]
        assert len(run.of("failure_detected")) == 1, [e["message"] for e in run.of("failure_detected")]
        first_grow = next(e for e in run.of("growing") if e["data"]["target_dp"] == 4)
        after = [e for e in run.events if e["id"] > first_grow["id"]]
        gen_after = next(e["data"] for e in after if e["kind"] == "generation")
        assert gen_after["dp"] == 2 and added[0] not in gen_after["nodes"], gen_after
        assert any(e["kind"] == "spare_lost" and e["data"].get("node") == added[0] for e in after), run.kinds()
        # The grown generation's ranks on the node that came back report through its new agent.
        assert not run.of("agents_missing"), [e["message"] for e in run.of("agents_missing")]
        assert added[1] in run.of("generation")[-1]["data"]["agents"], run.of("generation")[-1]
        # Its keeper and agent were started, and answered, while the group trained on: before the pause.
        ready = [e for e in run.of("helpers_ready") if e["data"]["node"] == added[1] and not e["data"].get("late")]
        growing = [e for e in run.of("growing") if e["data"]["target_dp"] == 4]
        assert ready and growing and ready[0]["id"] < growing[-1]["id"], [e["message"] for e in run.events[-12:]]
        # ...started as Ray placed the replica there, before its workers were ready (a swap taking that
        # replica at once would otherwise wait for them in its pause).
        started_at = ready[0]["ts"] - ready[0]["data"]["waited_s"]
        joined = [e for e in run.of("replica_ready") if added[1] in e["data"]["nodes"]]
        assert joined and started_at < joined[0]["ts"], (started_at, joined, ready[0]["message"])
        for ev in run.of("recovered"):
            assert ev["data"]["lost_steps"] <= 1, ev
            assert ev["data"]["pause_s"] > 0, ev  # the training time the recovery cost, from the rows
        # Each grow's pause of training, told once its first step came: the one that stayed at dp 2 too, then
        # the grow back to 4 (in one step, or 2 -> 3 -> 4 when the new node's replicas got ready more than the
        # grow wait apart on a loaded machine, as the resizes above allow).
        resumed = [e["data"] for e in run.of("resumed")]
        told = [(d["cause"], d["dp"]) for d in resumed]
        assert told[0] == ("growth", 2) and told[-1] == ("growth", 4), resumed
        assert {c for c, _ in told} == {"growth"} and [dp for _, dp in told] == sorted(dp for _, dp in told), resumed
        assert len(told) == 1 + sum(1 for e in run.of("resized")[1:] if e["data"]["new_dp"] > e["data"]["old_dp"]), (
            resumed, resizes)
        assert all(d["pause_s"] > 0 for d in resumed), resumed
        assert_same_losses(run.rows(), ref)
    finally:
        run.finish()
    assert_no_leaks(run.job_id)


def test_below_dp_min_waits_then_fails_and_releases(nodes_cluster: LocalCluster, tmp_path: Path) -> None:
    chaos = [*SLOW, {"kind": "kill_node", "step": 2, "rank": 0}]
    run = JobRun(tiny_spec(tmp_path, steps=STEPS, dp_min=4, chaos=chaos, ft={"wait_for_capacity_s": 3}))
    try:
        run.wait(timeout_s=400)
        assert run.status["state"] == "FAILED", run.events
        reason = run.status["reason"]
        assert "below dp.min=4" in reason and "wait_for_capacity_s=3" in reason, reason
        assert run.of("waiting_for_capacity")
        assert run.of("released")
    finally:
        run.finish()
    assert_no_leaks(run.job_id)


def _running(pid: int) -> bool:
    """Whether `pid` is a process that is neither gone, nor a zombie, nor on its way out (SIGKILL pending
    for it, or the kernel's PF_EXITING set: a SIGKILLed process with a large heap takes a moment to exit)."""
    try:
        fields = stat_fields(pid)
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    pending = {k: int(v, 16) for k, v in (line.split(":\t") for line in status.splitlines()
                                          if line.startswith(("SigPnd:", "ShdPnd:")))}
    exiting = int(fields[6]) & 0x4  # PF_EXITING
    sigkill = any(mask & (1 << 8) for mask in pending.values())  # signal 9's bit
    return fields[0] not in ("Z", "X") and not exiting and not sigkill
