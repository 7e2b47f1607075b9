"""Fencing in the runtime: once generation g+1 begins, a write of generation g (a stale worker whose
send was delayed past the recovery) is refused by the keepers, because the supervisor fenced them
when it launched g+1, not only when a snapshot of g+1 is committed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import ray

from checkpointing.naming import NAMESPACE, keeper_name
from tests.runtime.jobs import JobRun, assert_no_leaks, tiny_spec


def test_a_stale_generations_snapshot_write_is_refused(head_cluster: Any, tmp_path: Path) -> None:
    # Snapshots at steps 8 and 16: generation 1 restores step 8 and commits nothing new before step 16,
    # so only the supervisor's fence at its launch can refuse generation 0 meanwhile.
    # Generation 1 is slowed (0.5 s a step), so this test sees it begin well before it commits step 16.
    chaos = [{"kind": "kill_worker", "step": 9, "rank": 1},
             {"kind": "slow_worker", "step": 8, "rank": 0, "seconds": 0.5, "generation": 1}]
    run = JobRun(tiny_spec(tmp_path, steps=16, dp=2, chaos=chaos, ckpt={"in_memory_every": 8}))
    seen: dict[str, Any] = {}

    def stale_write(ev: dict[str, Any]) -> None:
        if ev["kind"] != "generation" or ev["data"]["generation"] != 1 or seen:
            return
        keeper = ray.get_actor(keeper_name(ev["data"]["keepers"][0]), namespace=NAMESPACE)
        seen["committed"] = ray.get(keeper.holdings.remote(run.job_id), timeout=30)["committed"]
        try:
            ray.get(keeper.put_shard.remote(run.job_id, 0, 5, 0, 2, b"", b"", np.zeros(8, dtype=np.uint8)),
                    timeout=30)
            seen["error"] = None
        except ray.exceptions.RayTaskError as e:
            seen["error"] = str(e)

    try:
        status = run.wait(on_event=stale_write)
        assert status["state"] == "SUCCEEDED", run.kinds()
        assert seen, run.kinds()
        assert all(g == 0 for g, _ in seen["committed"]), seen  # no commit of generation 1 fenced it before
        assert seen["error"] is not None and "fenced at generation 1" in seen["error"], seen
        assert "a stale worker" in seen["error"], seen
    finally:
        run.finish()
    assert_no_leaks(run.job_id)
