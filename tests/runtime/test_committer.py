"""The supervisor's snapshot commit (service.supervisor.committer.SnapshotCommitter.commit) against
real keepers on a 2-node LocalCluster.

The watch loop calls `commit` between its looks for failures, so a keeper that does not answer (its
process stopped, as on a node that is going) must not hold the loop up: the call returns with the
commit still in flight, and a later call lands it once the keeper answers. A keeper that died after
the ranks' acks named it is left out: the live keepers are asked what they hold, and with one node
left one copy is enough.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from checkpointing.keepers import ensure_keepers, memory_reports
from checkpointing.snapshot import SnapshotClient
from service.local_cluster import LocalCluster
from service.spec import JobSpec
from service.supervisor.committer import SnapshotCommitter
from service.supervisor.context import JobRun
from service.supervisor.reporter import Reporter

JOB = "commit-job"


@pytest.fixture(scope="module")
def keepers() -> Iterator[dict[str, Any]]:
    with LocalCluster(head_cpus=2, object_store_mb=200) as cluster:
        cluster.add_node("b", num_cpus=1)
        cluster.connect()
        yield ensure_keepers(["head", "b"], memory_limit_mb=64)


def _committer(tmp_path: Path, keepers: dict[str, Any]) -> SnapshotCommitter:
    spec = JobSpec.model_validate({"name": "commit", "checkpoint": {"in_memory_every": 1}})
    run = JobRun(job_id=JOB, spec=spec, namespace="t", store=None, restarted=False, self_handle=None, mp=1,
                 cp_tp=1, per_worker={"CPU": 1.0}, dp_min=1, dp_max=4, output_dir=tmp_path)
    reporter = Reporter(run, None)
    reporter.last_row_step = 100  # every step's metrics row is written: the commit may go up to it
    committer = SnapshotCommitter(run, reporter)
    committer.keeper_set.handles = dict(keepers)
    return committer


def _snapshot(keepers: dict[str, Any], step: int) -> list[str]:
    """Rank 0 of a world of 1 sends step `step` (generation 0) to its keepers; the nodes that hold it."""
    client = SnapshotClient(JOB, 0, 1, "head", keepers)
    try:
        res = client.snapshot({"w": torch.arange(4096.0) + step}, step=step, generation=0).result(timeout=60)
    finally:
        client.close()
    assert res.ok, res
    return list(res.acked)


def _acked_on_both(tmp_path: Path, keepers: dict[str, Any], step: int) -> SnapshotCommitter:
    """A committer that holds rank 0's ack of step `step`, sent to both keepers."""
    acked = _snapshot(keepers, step)
    assert sorted(acked) == ["b", "head"]
    committer = _committer(tmp_path, keepers)
    committer.on_ack(0, step, 0, 1, True, acked)
    return committer


def _committed_on(keepers: dict[str, Any]) -> dict[str, list[tuple[int, int]]]:
    reports = memory_reports(keepers)
    return {n: [tuple(c) for c in r["jobs"].get(JOB, {}).get("committed", [])] for n, r in reports.items()}


def _until_committed(committer: SnapshotCommitter, key: tuple[int, int]) -> None:
    deadline = time.monotonic() + 60
    while committer.committed != key:
        assert time.monotonic() < deadline, f"snapshot {key} was never committed: {committer.committed}"
        committer.commit()
        time.sleep(0.05)


@pytest.mark.timeout(300)
def test_a_keeper_that_does_not_answer_holds_up_no_commit_call(keepers: dict[str, Any], tmp_path: Path) -> None:
    committer = _acked_on_both(tmp_path, keepers, 1)
    pid = ray.get(keepers["b"].__ray_call__.remote(lambda _self: os.getpid()))
    os.kill(pid, signal.SIGSTOP)
    try:
        for _ in range(3):  # each call returns with the commit in flight; none changes what is committed
            committer.commit()
            assert committer.committed is None
    finally:
        os.kill(pid, signal.SIGCONT)
    _until_committed(committer, (0, 1))
    assert all((0, 1) in c for c in _committed_on(keepers).values()), _committed_on(keepers)


@pytest.mark.timeout(300)
def test_a_keeper_dead_since_the_acks_is_left_out_of_the_commit(keepers: dict[str, Any], tmp_path: Path) -> None:
    committer = _acked_on_both(tmp_path, keepers, 2)
    ray.kill(keepers["b"], no_restart=True)
    _until_committed(committer, (0, 2))  # the live keeper is asked what it holds: one copy of one node
    assert (0, 2) in _committed_on({"head": keepers["head"]})["head"]
