"""The short chaos soak in the default suite (`make soak` runs the long one): the same driver and checks
(tests/soak/) on a tiny model, 60 steps and 5 faults of mixed kinds (seed 3: a worker killed and the
supervisor SIGKILLed in the middle of that recovery, a worker killed while a checkpoint is written to
S3, PostgreSQL restarted, a straggler replaced), through `ray start` nodes, PostgreSQL, SeaweedFS,
`unbroken serve` and the SDK. It checks what the long soak checks: the job SUCCEEDED with the fault-free
run's losses, no failure (a supervisor restart included) lost more than one step, every checkpoint left
is valid, nothing leaked, and each fault is in the events with its cause. UNBROKEN_SOAK_SEED=N tries
another mix; `make soak-short` runs it alone.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.runtime.jobs import TINY_MODEL
from tests.soak.soak import SoakConfig, run_soak


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_short_soak(tmp_path: Path) -> None:
    seed = int(os.environ.get("UNBROKEN_SOAK_SEED", "3"))
    cfg = SoakConfig(steps=60, faults=5, seed=seed, worker_nodes=2, cpus_per_node=2, dp_max=3, persist_every=10,
                     min_gap=6, model=TINY_MODEL, timeout_s=600, root=tmp_path)
    res = run_soak(cfg)
    print(f"\nshort soak: seed {seed}, job {res.job_id}, {res.wall_s:.0f}s\n{res.table}")
    assert res.verdict.ok, "\n".join(res.verdict.problems) + "\n" + res.table
    assert len(res.verdict.rows) >= 5
