"""Hot spares (resources.spares) on a real two-node LocalCluster, through the control plane (job store,
scheduler, REST API, SDK) and through the supervisor.

A 3-replica job (HSDP 3 x 1) keeps one warm spare replica: rank 1 is killed at step 3; the next generation takes
the spare in its place, so dp stays 3 (no `resized` event) and every step's loss equals the uninterrupted
run's at the same dp (≤1e-4, fp32). The survivors train on in the model objects they held
(workers.kept_trainer); one of them reads the snapshot and the spare heals from it (checkpointing.peer_heal).
A new spare is started in place of the one used, and the spares show
in the events, the metrics rows and the API. (Without a spare a job shrinks as before: test_faults checks
that no spare is told of there.) A spare that dies while it waits is dropped and replaced before a failure
could pick it, and so is one that hangs.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.local_cluster import LocalCluster
from tests.runtime.conftest import make_cluster
from tests.runtime.jobs import JobRun, assert_no_leaks, assert_same_losses, engine_of, tiny_spec

STEPS = 24
KILL = {"kind": "kill_worker", "step": 3, "rank": 1}
# After the swap rank 0 sleeps before each step, so the job lasts long enough for the replacement spare
# to start (a new worker process) before it ends; the losses do not depend on it.
SLOW = {"kind": "slow_worker", "step": 4, "rank": 0, "seconds": 0.5, "generation": 1}


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """Head with room for four 0.5-CPU workers, node b for two: the group and a spare on another node."""
    yield from make_cluster(2, {"b": 1})


def spec(out: Path, *, spares: int, chaos: list[dict[str, Any]] | None = None) -> Any:
    s = tiny_spec(out, steps=STEPS, dp=3, dp_min=3, chaos=chaos)  # whole replicas: dp.min a multiple of 3
    # Three replicas of the whole model (HSDP over 3 x 1): a newcomer can heal from a live replica.
    par = s.parallelism.model_copy(update={"dp_replicate": 3, "dp_shard": 1})
    return s.model_copy(update={"resources": s.resources.model_copy(update={"spares": spares}), "parallelism": par})


@pytest.fixture(scope="module")
def reference(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The uninterrupted run at the same dp (3 processes, the local launcher: no Ray, no faults)."""
    from workers.launcher import run_local

    out = tmp_path_factory.mktemp("ref")
    res = run_local(engine_of(spec(out, spares=0)), 3, out, show_progress=False)
    rows = [json.loads(x) for x in Path(res.metrics_path).read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)) and {r["dp"] for r in rows} == {3}
    return rows


def _check_swapped(events: list[dict[str, Any]], rows: list[dict[str, Any]], ref: list[dict[str, Any]]) -> None:
    kinds = [e["kind"] for e in events]
    assert "failure_detected" in kinds and "resized" not in kinds, kinds
    gens = [e["data"] for e in events if e["kind"] == "generation"]
    assert [g["dp"] for g in gens] == [3, 3], gens
    swapped = [e for e in events if e["kind"] == "spare_swapped"]
    assert len(swapped) == 1, kinds
    assert swapped[0]["data"]["dp"] == swapped[0]["data"]["old_dp"] == 3, swapped[0]
    assert "dp stays 3" in swapped[0]["message"], swapped[0]["message"]
    # The spare was warm and outside the group: it joined generation 1 as a new rank, from memory.
    spare = swapped[0]["data"]["replicas"][0]
    ranks0, ranks1 = gens[0]["ranks"], gens[1]["ranks"]
    assert len(ranks0) == len(ranks1) == 3 and set(ranks0) != set(ranks1), (ranks0, ranks1)
    # Only the lost rank changed hands: the survivors kept theirs, the spare took rank 1.
    assert all(ranks1[w] == r for w, r in ranks0.items() if w in ranks1), (ranks0, ranks1)
    assert sorted(r for w, r in ranks1.items() if w not in ranks0) == [1], (ranks0, ranks1)
    recovered = [e["data"] for e in events if e["kind"] == "recovered"]
    assert recovered and recovered[0]["lost_steps"] <= 1, recovered
    # The survivors kept their places, so they trained on in the same processes and model objects (the
    # supervisor compares each worker's pid and model id with the last generation's); the spare built its own.
    assert recovered[0]["in_place_ranks"] == [0, 2], recovered[0]
    # One replica (rank 0, kept in place) read the snapshot from the keepers; the others healed from it.
    assert recovered[0]["source"] == ["keepers", "peer"], recovered[0]
    # Before the fault one spare was ready; after it, none, then a new one (replenished), never the old one.
    told = [e["data"] for e in events if e["kind"] == "spares"]
    before = [t for t in told if t["generation"] == 0]
    assert before and before[-1]["spares"] == 1 and spare in before[-1]["replicas"], told
    after = [t for t in told if t["generation"] == 1]
    assert after and after[-1]["spares"] == 1 and spare not in after[-1]["replicas"], told
    # Where the cluster allowed it, the spare sat away from the group's nodes.
    if before[-1]["apart"] == 0:
        assert set(before[-1]["group_nodes"]) == {"head", "b"}, before[-1]
    # Every row: dp 3; rows carry the spares ready at their step; the losses are the uninterrupted run's.
    assert {r["dp"] for r in rows} == {3}, [r["dp"] for r in rows]
    assert {r["spares"] for r in rows} <= {0, 1} and rows[0]["spares"] == 1, [r.get("spares") for r in rows]
    assert_same_losses(rows, ref)


@pytest.mark.timeout(600)
def test_spares_through_the_control_plane(reference: list[dict[str, Any]], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Submitted with the SDK, admitted by the scheduler with its spare counted, the same swap; the API
    shows the spares in the job's progress and events."""
    from tests.control_plane import ControlPlane

    monkeypatch.setenv("UNBROKEN_HOME", str(tmp_path / "home"))
    cp = ControlPlane(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        client = cp.client()
        job = client.submit(spec(tmp_path / "job", spares=1, chaos=[KILL, SLOW]))
        done = client.wait(job.id, timeout=420)
        assert done.status == "SUCCEEDED", done
        events = [{"kind": e.kind, "message": e.message, "data": e.data or {}}
                  for e in client.events(job.id, follow=False)]
        _check_swapped(events, client.metrics(job.id), reference)
        started = [e for e in events if e["kind"] == "replica_ready"]
        assert len(started) == 5, [e["message"] for e in started]  # 3 in the group, the spare, its replacement
        got = client.get(job.id)
        assert got.progress.spares in (0, 1) and got.progress.dp == 3, got.progress
        assert got.spec is not None and got.spec["resources"]["spares"] == 1
        assert_no_leaks(job.id)
    finally:
        cp.stop()


@pytest.mark.timeout(600)
def test_a_dead_or_hung_spare_is_replaced_before_it_is_needed(cluster: LocalCluster, tmp_path: Path) -> None:
    """A spare whose worker dies while it waits is found dead by its ping (Ray's actor error) or its
    node agent's look at its process; the one that replaces it is then SIGSTOPped, and its node agent
    finds its process stopped. Neither waits out heartbeat_timeout_s (20 s here, as in every test job: a
    short one reads a loaded host's slow heartbeats as hangs). Each is dropped (`spare_lost`) and a new
    spare started, so a later failure would not pick a dead or hung one; the group is not touched."""
    import os
    import signal
    import time

    import ray

    slow = {"kind": "slow_worker", "step": 2, "rank": 0, "seconds": 0.5, "generation": 0}
    s = spec(tmp_path, spares=1, chaos=[slow])
    s = s.model_copy(update={"training": s.training.model_copy(update={"steps": 90})})
    run = JobRun(s)
    hit: list[tuple[str, int]] = []  # (worker, pid): killed, then stopped

    def the_spare() -> tuple[str, int]:
        members = next(e for e in reversed(run.events) if e["kind"] == "generation")["data"]["ranks"]
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith(f"job-{run.job_id}/worker-") and a["name"] not in members
                 and a["name"] not in {w for w, _ in hit}]
        assert len(names) == 1, names
        info = ray.get(ray.get_actor(names[0], namespace="unbroken").info.remote(), timeout=30)
        return names[0], int(info["pid"])

    def strike(ev: dict[str, Any]) -> None:
        if ev["kind"] != "spares" or ev["data"]["spares"] != 1 or len(hit) >= 2:
            return
        name, pid = the_spare()
        if not hit:
            ray.kill(ray.get_actor(name, namespace="unbroken"), no_restart=True)
        else:
            os.kill(pid, signal.SIGSTOP)
        hit.append((name, pid))
        time.sleep(0.1)

    try:
        st = run.wait(on_event=strike)
        assert st["state"] == "SUCCEEDED", run.events
        assert len(hit) == 2, run.kinds()
        lost = run.of("spare_lost")
        assert [e["data"]["worker"] for e in lost] == [w for w, _ in hit], [e["message"] for e in lost]
        assert [e["data"]["how"] for e in lost] == ["died", "stopped"], [e["message"] for e in lost]
        assert "stopped" in lost[1]["message"], lost[1]["message"]
        told = [e["data"] for e in run.of("spares")]
        gone = [i for i, t in enumerate(told) if t["spares"] == 0]
        assert len(gone) >= 2 and told[gone[-1] + 1:] and told[-1]["spares"] == 1, told  # a new one each time
        assert not run.of("failure_detected") and {r["dp"] for r in run.rows()} == {3}
    finally:
        run.finish()
        for _, pid in hit[1:]:  # the stopped one, were it left (the supervisor SIGKILLs it)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert_no_leaks(run.job_id)
