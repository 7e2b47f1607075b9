"""The in-memory tier on a real 2-node LocalCluster ("head" + "b"), 4 ranks as Ray actors (2 a node).

One cluster, one set of actors, phases in order (one test: start-up dominates the cost):
  keepers alone   a keeper that dies as it starts is named (KeepersNotStarted); memory limit refusal (clear error), fencing of an old generation, drop_job back to 0;
                  3 throwaway keepers: restore reads a live copy of each shard, SnapshotLost naming the
                  rank once both copies of its shard are gone; a dead keeper's copies go to the next
                  keeper in the ring, and back to a keeper started again under its name
  world 4         FSDP Trainer, 12 steps; snapshots of steps 1-3 sent to two keepers each and
                  committed (retention keeps 2 and 3), step 2 also persisted to file://
  world 2, 3      fresh Trainers with other weights restore the committed step 3 (resharded): the
                  full gathered state equals the world-4 one, the next 4 losses match the run
  node b killed   (its ranks and its keeper die) world 2 restores from keeper-head's copies only
  keeper-head killed  both copies of every shard gone: SnapshotLost, and restore_with_fallback loads
                  the persistent step 2 (state and next losses match), its RestoreInfo says why
  teardown        no keeper left
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from checkpointing.keeper import NAMESPACE, Keeper, keeper_name
from checkpointing.keepers import (
    KeepersNotStarted,
    commit_snapshot,
    drop_job,
    ensure_keepers,
    fence_job,
    kill_keepers,
    latest_committed,
    memory_reports,
)
from checkpointing.shard_stream import MAX_KEPT
from checkpointing.snapshot import SnapshotClient, SnapshotLost, restore_from_keepers
from service.local_cluster import LocalCluster
from tests.checkpointing.keeper_ranks import RankActor
from workers.ports import free_port

JOB = "job-keepers"
LIMIT_MB = 16


def _keepers_alone(keepers: dict[str, ray.actor.ActorHandle]) -> None:
    # Refusal: a 20 MiB shard against a 16 MiB limit, on both keepers, with the fix in the message.
    big = SnapshotClient("too-big", 0, 1, "head", keepers)
    res = big.snapshot({"w": torch.zeros(5 * 2**20)}, step=1, generation=0).result(timeout=60)
    big.close()
    assert not res.ok and set(res.errors) == {"head", "b"}, res
    for err in res.errors.values():
        assert "KeeperMemoryFull" in err and "too-big" in err and "16 MiB limit" in err, err
        assert "checkpoint.keeper_memory_limit_mb" in err and "in_memory_every" in err, err
    assert all(r["refused"] >= 1 and r["used_bytes"] == 0 for r in memory_reports(keepers).values())

    # Fencing: after fence(3), generation 2's shards are refused, generation 3's kept and committed.
    fence_job(keepers, "fenced", 3)
    cl = SnapshotClient("fenced", 0, 1, "b", keepers)
    stale = cl.snapshot({"w": torch.ones(10)}, step=7, generation=2).result(timeout=60)
    assert not stale.ok and all("StaleGeneration" in e for e in stale.errors.values()), stale
    fresh = cl.snapshot({"w": torch.ones(10)}, step=7, generation=3).result(timeout=60)
    assert fresh.ok and fresh.acked == ["b", "head"], fresh
    assert not commit_snapshot(keepers, "fenced", 2, 7, 1)  # nothing of generation 2 is held
    assert commit_snapshot(keepers, "fenced", 3, 7, 1)
    assert latest_committed(keepers, "fenced") == 7
    cl.close()

    # The optimizer hook: the copy (started by snapshot) finishes before optimizer.step() changes
    # the parameter; abandon() (a worker's failure path) removes the hook and returns at once.
    w = torch.nn.Parameter(torch.ones(1000))
    opt = torch.optim.SGD([w], lr=1.0)
    hooked = SnapshotClient("fenced", 0, 1, "head", keepers, optimizer=opt)
    handle = hooked.snapshot({"w": w}, step=8, generation=3)
    w.grad = torch.ones(1000)
    opt.step()  # w becomes 0 only after the snapshot's copy of the ones
    assert handle.result(timeout=60).ok and commit_snapshot(keepers, "fenced", 3, 8, 1)
    got = {"w": torch.full((1000,), 5.0)}
    restore_from_keepers(keepers, "fenced", got)
    assert torch.equal(got["w"], torch.ones(1000)) and torch.equal(w.detach(), torch.zeros(1000))
    hooked.abandon()
    opt.step()

    # The keeper on the client's node keeps its segments as the shards' bytes (no copy) and hands each
    # back once retention frees it: over many snapshots the client reuses a bounded set of buffers, and
    # both retained snapshots read back as they were sent (no later snapshot was written over them).
    kept = SnapshotClient("fenced", 0, 1, "head", keepers)
    before = memory_reports(keepers)["head"]["frames"]["kept"]
    for step in range(9, 21):
        res = kept.snapshot({"w": torch.full((1000,), float(step))}, step=step, generation=3).result(timeout=60)
        assert res.ok and commit_snapshot(keepers, "fenced", 3, step, 1), res
    assert 2 <= len(kept._buffers) <= MAX_KEPT + 2, len(kept._buffers)
    for step in (19, 20):
        got = {"w": torch.zeros(1000)}
        restore_from_keepers(keepers, "fenced", got, step=step, generation=3)
        assert torch.equal(got["w"], torch.full((1000,), float(step))), (step, got["w"][:3])
    assert memory_reports(keepers)["head"]["frames"]["kept"] - before == 12  # every one: it retains 2, keeps 4
    # Its connection to that keeper breaks: the segments kept there would come back on that connection
    # only, so the client leaves them to the keeper (never writes into them again) and goes on.
    lent = [b for b in kept._buffers if b.lent]
    assert lent
    kept._conns["head"][1]._sock.shutdown(socket.SHUT_RDWR)
    res = kept.snapshot({"w": torch.full((1000,), 21.0)}, step=21, generation=3).result(timeout=60)
    assert res.ok and commit_snapshot(keepers, "fenced", 3, 21, 1), res
    assert not any(b in kept._buffers for b in lent)
    for step in (20, 21):  # the kept step 20 was not written over
        got = {"w": torch.zeros(1000)}
        restore_from_keepers(keepers, "fenced", got, step=step, generation=3)
        assert torch.equal(got["w"], torch.full((1000,), float(step))), (step, got["w"][:3])
    kept.close()

    # drop_job frees everything the job held.
    reports = memory_reports(keepers)
    assert all(r["used_bytes"] > 0 and "fenced" in r["jobs"] for r in reports.values()), reports
    assert drop_job(keepers, "fenced") > 0
    reports = memory_reports(keepers)
    assert all(r["used_bytes"] == 0 and r["jobs"] == {} for r in reports.values()), reports


def _kill(handle: Any) -> None:
    """ray.kill, then until the keeper answers no more: the kill is asynchronous, and a restore asked
    right after it could still find the keeper holding its copies (CI saw that)."""
    ray.kill(handle)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(handle.ping.remote(), timeout=5)
        except Exception:  # noqa: BLE001 - gone
            return
        time.sleep(0.05)
    raise AssertionError("the killed keeper still answers after 30 s")


def _partial_loss() -> None:
    """Three throwaway keepers x, y, z (ranks 0, 1, 2 "on" them): each shard goes to its own keeper
    and the next; restore reads each rank's shard from a live holder until both copies of one are gone."""
    actor_cls = ray.remote(Keeper)
    ks = {n: actor_cls.options(num_cpus=0, max_concurrency=4).remote(n, 16) for n in ("x", "y", "z")}
    try:
        for rank, node in enumerate(("x", "y", "z")):
            cl = SnapshotClient("partial", rank, 3, node, ks)
            assert cl.targets == [node, {"x": "y", "y": "z", "z": "x"}[node]]
            res = cl.snapshot({f"r{rank}": torch.full((3, 5), float(rank))}, step=4, generation=1).result(
                timeout=60
            )
            assert res.ok, res
            cl.close()
        assert commit_snapshot(ks, "partial", 1, 4, 3)

        def restore(**kw: Any) -> tuple[dict[str, torch.Tensor], Any]:
            state = {f"r{r}": torch.zeros(3, 5) for r in range(3)}
            info = restore_from_keepers(ks, "partial", state, **kw)
            for r in range(3):
                assert torch.equal(state[f"r{r}"], torch.full((3, 5), float(r))), state
            return state, info

        _, info = restore()
        assert info.copies_used == {0: "x", 1: "y", 2: "x"} and info.single_copy_ranks == [], info
        _kill(ks["z"])
        _, info = restore()
        assert info.copies_used == {0: "x", 1: "y", 2: "x"} and info.single_copy_ranks == [1, 2], info
        assert "z" in info.unreachable_keepers
        # Who holds what, as the supervisor found it before z died (and a node "w" whose keeper is no longer
        # in the set): read without asking the keepers; the dead z, tried first, gives way to the other copy.
        known = (3, {0: ["x", "y"], 1: ["y", "z", "w"], 2: ["z", "x"]})
        _, info = restore(step=4, generation=1, prefer_node="z", known=known)
        assert info.copies_used == {0: "x", 1: "y", 2: "x"} and info.unreachable_keepers == {}, info  # not asked
        _kill(ks["y"])  # rank 1's shard was on y and z: both copies gone
        with pytest.raises(SnapshotLost, match=r"rank\(s\) \[1\]'s shards is gone"):
            restore()
        with pytest.raises(SnapshotLost, match=r"rank\(s\) \[1\]'s"):
            restore(step=4, generation=1, known=known)
    finally:
        for h in ks.values():
            ray.kill(h)


def _rerouted_copies() -> None:
    """A keeper dies between re-forms: the sender's copy for it goes to the next keeper in the ring that
    holds none (two copies still, the snapshot commits), and once a keeper of that name is started again
    (the supervisor does that) the copies go back to it."""
    actor_cls = ray.remote(Keeper)
    ks = {n: actor_cls.options(num_cpus=0, max_concurrency=4).remote(n, 16) for n in ("x", "y", "z")}
    fresh = None
    try:
        cl = SnapshotClient("reroute", 0, 1, "x", ks)
        assert cl.targets == ["x", "y"]
        ray.kill(ks["y"], no_restart=True)
        res = cl.snapshot({"w": torch.ones(8)}, step=1, generation=0).result(timeout=60)
        assert res.ok and sorted(res.acked) == ["x", "z"], res
        assert commit_snapshot({n: ks[n] for n in ("x", "z")}, "reroute", 0, 1, 1)
        fresh = actor_cls.options(name=keeper_name("y"), namespace=NAMESPACE, num_cpus=0).remote("y", 16)
        ray.get(fresh.ping.remote())
        res = cl.snapshot({"w": torch.full((8,), 2.0)}, step=2, generation=0).result(timeout=60)
        assert res.ok and sorted(res.acked) == ["x", "y"], res
        assert ray.get(fresh.held.remote("reroute", 0, 2)) == [0] and cl.keepers["y"] == fresh
        cl.close()
    finally:
        for h in [*ks.values(), *([fresh] if fresh is not None else [])]:
            ray.kill(h)


@pytest.mark.timeout(900)
def test_keepers_snapshot_reshard_node_loss_fallback(tmp_path: Path) -> None:
    ckpt_uri = f"file://{tmp_path / 'ckpt'}"
    # Ray's default health checks: the fast ones mark a node dead when ~8 engineers load 2 cores.
    with LocalCluster(head_cpus=2, fast_failure_detection=False) as cluster:
        cluster.add_node("b", num_cpus=2)
        cluster.connect()
        # A keeper that dies as it starts (here: its creation refuses the limit) is named, with the
        # keepers that did start, not raised as Ray's own error (a supervisor would die of that).
        with pytest.raises(KeepersNotStarted, match=r"nodes \['b'\] died as they started.*memory_limit_mb") as e:
            ensure_keepers(["b"], memory_limit_mb=0)
        assert e.value.started == {}
        keepers = ensure_keepers(["head", "b"], memory_limit_mb=LIMIT_MB)
        actor_cls = ray.remote(RankActor)
        actors = [
            actor_cls.options(num_cpus=0, resources={f"unbroken_node_{n}": 0.001}, max_concurrency=2).remote(
                str(tmp_path)
            )
            for n in ("head", "head", "b", "b")
        ]
        try:
            assert ray.get([a.node.remote() for a in actors]) == ["head", "head", "b", "b"]
            _keepers_alone(keepers)
            _partial_loss()
            _rerouted_copies()

            # ---- world 4: train, snapshot steps 1-3, commit them in order.
            port = free_port()
            outs = ray.get(
                [a.save_phase.remote(r, 4, port, JOB, keepers, ckpt_uri, 3) for r, a in enumerate(actors)]
            )
            losses = outs[0]["losses"]
            for r, out in enumerate(outs):
                for res in out["results"]:
                    assert res["ok"] and res["errors"] == {}, res
                    # own node first, then the other one
                    assert res["acked"] == (["head", "b"] if r < 2 else ["b", "head"]), res
            assert not commit_snapshot(keepers, JOB, 0, 4, 4)  # never sent: not committed
            for step in (1, 2, 3):
                assert commit_snapshot(keepers, JOB, 0, step, 4)
            assert latest_committed(keepers, JOB) == 3
            for node, rep in memory_reports(keepers).items():
                job = rep["jobs"][JOB]
                # retention: the last two committed snapshots, every rank's shard on each keeper
                assert job["committed"] == [(0, 2), (0, 3)], (node, job)
                assert job["shards"] == [(0, s, r) for s in (2, 3) for r in range(4)], (node, job)
                assert 0 < rep["used_bytes"] <= rep["limit_bytes"]

            # ---- restore at world 2 and 3 (resharding), from both copies.
            for world in (2, 3):
                port = free_port()
                outs = ray.get([
                    actors[r].restore_phase.remote(r, world, port, JOB, keepers, ckpt_uri, losses, False)
                    for r in range(world)
                ])  # fmt: skip
                info = outs[0]["info"]
                assert info["source"] == "keepers" and info["step"] == 3 and info["world_size"] == 4, info
                assert outs[0]["entries"] > 50 and outs[0]["loss_diff"] <= 1e-5
                # every snapshot rank was read by some new rank, each from its own node's keeper
                used = {}
                for r, out in enumerate(outs):
                    for old, node in out["info"]["copies_used"].items():
                        assert node == ("head" if r < 2 else "b"), (r, out["info"])
                        used[int(old)] = node
                assert sorted(used) == [0, 1, 2, 3], used

            # ---- node b lost: its ranks and its keeper die; restore from keeper-head alone.
            b_id = cluster.node_id("b")
            cluster.kill_node("b")
            # Restore once Ray has seen the loss (~3 s with LocalCluster's health checks), as the
            # supervisor does: before that a dead keeper can still look reachable.
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and any(n["NodeID"] == b_id and n["Alive"] for n in ray.nodes()):
                time.sleep(0.2)
            port = free_port()
            outs = ray.get([
                actors[r].restore_phase.remote(r, 2, port, JOB, keepers, ckpt_uri, losses, False) for r in range(2)
            ])  # fmt: skip
            for out in outs:
                info = out["info"]
                assert info["source"] == "keepers" and info["step"] == 3, info
                assert "b" in info["unreachable_keepers"], info
                assert set(info["copies_used"].values()) == {"head"}, info
                assert info["single_copy_ranks"] == [0, 1, 2, 3], info

            # ---- keeper-head lost too: both copies gone -> SnapshotLost -> persistent step 2.
            ray.kill(keepers["head"], no_restart=True)
            port = free_port()
            outs = ray.get([
                actors[r].restore_phase.remote(r, 2, port, JOB, keepers, ckpt_uri, losses, True) for r in range(2)
            ])  # fmt: skip
            for out in outs:
                info = out["info"]
                assert "no committed in-memory snapshot" in out["lost"], out
                assert info["source"] == "persistent" and info["step"] == 2, info
                assert info["fallback_reason"] and info["uri"].startswith("file://"), info
            assert outs[0]["loss_diff"] <= 1e-5
        finally:
            for a in actors:
                ray.kill(a, no_restart=True)
            kill_keepers(keepers)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
            if not names & {keeper_name("head"), keeper_name("b")}:
                break
            time.sleep(0.5)
        assert not names & {keeper_name("head"), keeper_name("b")}, names
