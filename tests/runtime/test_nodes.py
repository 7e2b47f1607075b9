"""Node loss on a 3-node cluster: the head runs no workers; nodes b and c hold two workers each.

Node c is killed (every process of it): the agent of b, which leads the agent group, finds it silent;
the job shrinks 4 -> 2; a node added later lets it grow back to 4 at a snapshot boundary, with the
fault-free losses (those of the local launcher's run).
Then, with dp.min = 4, a node loss leaves the job below its minimum: it waits, fails with a
clear reason and releases everything.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.local_cluster import LocalCluster
from tests.runtime.conftest import make_cluster
from tests.runtime.jobs import JobRun, assert_no_leaks, assert_same_losses, engine_of, tiny_spec

STEPS = 60
SLOW = [{"kind": "slow_worker", "step": 0, "rank": r, "seconds": 0.4} for r in range(4)]  # time to grow


@pytest.fixture(scope="module")
def nodes_cluster() -> Iterator[LocalCluster]:
    yield from make_cluster(0, {"b": 1, "c": 1})


def test_node_loss_shrinks_then_a_new_node_grows_it_back(nodes_cluster: LocalCluster, tmp_path: Path) -> None:
    """Node c (a member of the agent group b leads) is killed at step 3: b's agent finds it silent, the
    job shrinks 4 -> 2, and a node added then lets it grow back to 4, with the fault-free losses."""
    import ray

    from workers.launcher import run_local

    ref = run_local(engine_of(tiny_spec(tmp_path / "ref", steps=STEPS)), 4, tmp_path / "ref", show_progress=False)
    ref_rows = [json.loads(x) for x in Path(ref.metrics_path).read_text().splitlines()]

    run = JobRun(tiny_spec(tmp_path / "job", steps=STEPS, chaos=SLOW))
    added: list[float] = []

    def on_event(ev: dict[str, Any]) -> None:
        if ev["kind"] == "resized" and ev["data"]["new_dp"] == 2 and not added:
            nodes_cluster.add_node("d", num_cpus=1)  # capacity returns
            added.append(time.time())

    try:
        deadline = time.monotonic() + 300
        while ray.get(run.handle.status.remote(), timeout=30)["step"] < 3:
            assert time.monotonic() < deadline, run.kinds()
            run.poll()
            time.sleep(0.3)
        gen0 = run.of("generation")[0]["data"]
        assert gen0["world_size"] == 4 and gen0["agents"] == ["b", "c"], gen0
        nodes_cluster.kill_node("c")  # a member of b's group: b's agent sees it fall silent
        run.wait(timeout_s=600, on_event=on_event)
        assert run.status["state"] == "SUCCEEDED", [(e["kind"], e["message"]) for e in run.events][-12:]
        silent = run.of("agent_silent")  # b's agent saw c fall silent (then the supervisor confirms, or
        # Ray's report of the dead workers ends the generation first)
        assert silent and silent[0]["data"]["node"] == "c" and silent[0]["data"]["leader"] == "b", run.kinds()
        # Nothing alive was suspected (node d, new and starting on a loaded machine, may be, briefly).
        assert not [e for e in run.of("agent_answered") if e["data"]["node"] != "d"], run.of("agent_answered")
        # The recovery starts from whichever report comes first: Ray's of the node's dead workers (often
        # before the node is marked dead: worker_died), the agents', or a broken collective.
        first = run.of("failure_detected")[0]["data"]
        assert first["kind"] in ("node_died", "worker_died", "collective_error"), first
        resizes = [(e["data"]["old_dp"], e["data"]["new_dp"]) for e in run.of("resized")]
        # Shrink to the two workers left, then grow back to 4 (in one step or as replicas get ready).
        assert resizes[0] == (4, 2) and resizes[-1][1] == 4, resizes
        assert all(e["data"]["cause"] == "growth" for e in run.of("resized")[1:])
        assert "b" in run.of("generation")[1]["data"]["agents"]
        for ev in run.of("recovered"):
            assert ev["data"]["lost_steps"] <= 1, ev
        assert_same_losses(run.rows(), ref_rows)
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
