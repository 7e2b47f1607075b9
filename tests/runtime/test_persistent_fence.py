"""Persistent checkpoints are fenced by the runtime, not only in unit tests.

A job writing persistent checkpoints loses a worker; generation 1 re-forms from step S and its rank 0
records the fence (1, S) in the job's checkpoint folder before it saves. A write of generation 0 that
arrives after that (a stale worker's upload, delayed past the re-form) for a step beyond S is refused
at commit and never becomes a checkpoint a restore could pick.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from checkpointing.catalog import read_fences
from checkpointing.config import CheckpointConfig
from checkpointing.persistent import CheckpointManager
from tests.runtime.jobs import JobRun, assert_no_leaks, tiny_spec

STEPS = 8


def test_a_stale_generation_cannot_commit_past_the_fence(head_cluster: Any, tmp_path: Path) -> None:
    root = (tmp_path / "ckpt").resolve().as_uri()
    spec = tiny_spec(tmp_path / "run", steps=STEPS, dp=2, chaos=[{"kind": "kill_worker", "step": 5, "rank": 1}],
                     ckpt={"persist_every": 2, "uri": root})
    run = JobRun(spec)
    st = run.wait()
    run.finish()
    assert st["state"] == "SUCCEEDED", run.kinds()
    resumed = run.of("recovered")[0]["data"]["restored_step"]

    mgr = CheckpointManager(CheckpointConfig(uri=root), "unused", rank=0, world_size=1)
    try:
        fences = [(f.generation, f.resume_step) for f in read_fences(mgr.store)]
        assert (1, resumed) in fences, fences
        stale_step = resumed + 1  # past the resume point, as generation 0 would have gone on
        res = mgr.save({"w": torch.zeros(4)}, stale_step, generation=0, layout={"dp": 1})
        assert not res.ok and "fenced" in str(res.error), res
        assert stale_step not in [c.step for c in mgr.list() if c.valid]
        latest = mgr.latest_valid(deep=False)
        assert latest is not None and latest.step == STEPS and latest.generation >= 1, latest
    finally:
        mgr.close()
    assert_no_leaks(run.job_id)
