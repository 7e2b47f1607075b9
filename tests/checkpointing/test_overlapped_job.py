"""The overlapped snapshot in a real job: a 4-worker FSDP job through the supervisor on two nodes,
in-memory snapshots every step and a persistent checkpoint every 3 steps, both copied beside the
next step's forward/backward (the optimizer step waits only for a copy still in flight).

A worker is SIGKILLed at step 5; the group re-forms at dp 3 from the keepers' copy of the last
committed step. Every step's loss equals the fault-free run's (<=1e-4: a copy torn by the next
optimizer step would show here), at most one step is lost, and each metrics row carries the
training thread's blocking time for the checkpoint tiers (`ckpt_block_s`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.local_cluster import LocalCluster
from tests.runtime.conftest import make_cluster
from tests.runtime.jobs import JobRun, assert_no_leaks, assert_same_losses, tiny_spec

STEPS = 10
CKPT = {"in_memory_every": 1, "persist_every": 3}


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """Head and node b, each with room for two 0.5-CPU workers (keepers on both)."""
    yield from make_cluster(1, {"b": 1})


def _run(out: Path, chaos: list[dict[str, Any]] | None = None) -> JobRun:
    run = JobRun(tiny_spec(out, steps=STEPS, chaos=chaos, ckpt=CKPT))
    try:
        run.wait()
    finally:
        run.finish()
    assert run.status["state"] == "SUCCEEDED", run.events
    assert_no_leaks(run.job_id)
    return run


@pytest.mark.timeout(600)
def test_overlapped_snapshot_restores_the_same_losses(cluster: LocalCluster, tmp_path: Path) -> None:
    ref = _run(tmp_path / "ref").rows()
    assert [r["step"] for r in ref] == list(range(1, STEPS + 1))
    run = _run(tmp_path / "faulty", [{"kind": "sigkill_worker", "step": 5, "rank": 1}])
    assert run.of("failure_detected"), run.kinds()
    recovered = run.of("recovered")
    assert recovered, run.kinds()
    for ev in recovered:  # from the keepers' overlapped copies, not the persistent fallback
        assert ev["data"]["lost_steps"] <= 1 and ev["data"]["source"] == ["keepers"], ev
    rows = run.rows()
    assert_same_losses(rows, ref)
    assert {r["dp"] for r in rows} >= {3, 4}, [r["dp"] for r in rows]
    for r in rows + ref:
        assert isinstance(r.get("ckpt_block_s"), float) and r["ckpt_block_s"] >= 0.0, r
        assert isinstance(r.get("end_time"), float), r
    # The persistent tier wrote through the same overlapped path (its checkpoints are valid).
    from checkpointing.catalog import list_checkpoints
    from checkpointing.uri import open_store

    store = open_store((tmp_path / "faulty" / "checkpoints").resolve().as_uri(), None)
    steps = [c.step for c in list_checkpoints(store) if c.valid]
    assert steps and max(steps) >= 9, steps
