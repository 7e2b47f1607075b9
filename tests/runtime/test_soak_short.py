"""The short chaos soak in the default suite (`make soak` runs the long one): the same driver and checks
(tests/soak/) on a tiny model, 60 steps and 5 faults of mixed kinds (seed 3: a worker killed and the
supervisor SIGKILLed in the middle of that recovery, a worker killed while a checkpoint is written to
S3, PostgreSQL restarted, a straggler replaced), through `ray start` nodes, PostgreSQL, SeaweedFS,
`unbroken serve` and the SDK. UNBROKEN_SOAK_SEED=N tries another mix.

Marked `soak`, so out of `make test` for now (`make soak-short` runs it): it finds a gap still open in
issue 17. A supervisor SIGKILLed mid-job comes back to the keepers' last commit while its workers trained
on, so more than one step is lost (seed 3: restored step 5 after the kill at step 8). It goes back into
the default run when that is fixed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.runtime.jobs import TINY_MODEL
from tests.soak.soak import SoakConfig, run_soak


@pytest.mark.soak
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
