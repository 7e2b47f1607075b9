"""The job store's PostgreSQL restarted under a running job, on the user's path: `unbroken serve --db`
on a private server (Debian's initdb/pg_ctl, its own port), a job through the SDK.

While the store is down the supervisor goes on training and holds its writes in order; the job's
events say the store went away and came back; afterwards the store has every metrics row once, in
order, the job's states and its final status: nothing the supervisor wrote was dropped.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from examples.user_cluster import Serve
from tests.runtime.jobs import paced
from tests.service.private_pg import private_postgres

DATA = "/usr/lib/python3.11/json"
STEPS = 60
DOWN_AT_STEP = 8
DOWN_S = 6.0


def job_spec() -> dict[str, Any]:
    return {
        "name": "store-outage",
        "model": {"dim": 32, "n_layers": 1, "n_heads": 2, "vocab_size": 256, "max_seq_len": 32},
        "data": {"kind": "text", "path": DATA},
        "training": {"steps": STEPS, "seq_len": 16, "global_batch_size": 8},
        "parallelism": {"dp_shard": 2},
        "resources": {"cpus_per_worker": 1, "dp": {"min": 2, "max": 2}},
        "checkpoint": {"in_memory_every": 1, "persist_every": 0},
        # Every step slowed (all ranks alike, so no straggler) keeps the job running through the outage.
        "chaos": paced(2, 0.25),
    }


def test_store_restart_mid_job_drops_nothing(tmp_path: Path) -> None:
    with private_postgres() as pg:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        serve = Serve(tmp_path / "home", address=None, env=env, extra=("--db", pg.url, "--num-cpus", "3"))
        try:
            serve.wait_ready()
            client = serve.client()
            job = client.submit(job_spec())
            deadline = time.monotonic() + 300
            while not client.metrics(job.id, after_step=DOWN_AT_STEP - 1):
                assert time.monotonic() < deadline, "the job did not reach its first steps"
                assert client.get(job.id).status not in ("FAILED", "CANCELLED"), client.get(job.id)
                time.sleep(0.5)
            pg.restart_after(DOWN_S)

            done = client.wait(job.id, timeout=400)
            assert done.status == "SUCCEEDED", done
            rows = client.metrics(job.id)
            assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "a metrics row was lost or doubled"
            events = list(client.events(job.id, follow=False))
            kinds = [e.kind for e in events]
            # The outage is told, in order, and the held writes landed after it.
            assert "store_unavailable" in kinds and "store_available" in kinds, kinds
            assert kinds.index("store_unavailable") < kinds.index("store_available")
            assert "store_write_failed" not in kinds, [e.message for e in events if e.kind == "store_write_failed"]
            down = next(e for e in events if e.kind == "store_unavailable")
            assert "held in order" in down.message, down.message
            # Nothing after the outage is missing: the job's last events reached the store.
            assert "released" in kinds, kinds
            assert any(e.kind == "status" and "SUCCEEDED" in e.message for e in events), kinds
        finally:
            serve.stop()


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__, "-q", "-s"]))
