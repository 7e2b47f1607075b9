"""NCCL: a peer's death does not hang a survivor; it aborts its communicators before destroying the
group, and re-forms a group in the same process (workers.group). Needs 2 GPUs."""

from __future__ import annotations

import pickle
import tempfile
from pathlib import Path

import pytest
import torch

from workers.ports import free_port

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(300)
def test_peer_death_abort_then_reform_in_the_same_process() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    import torch.multiprocessing as mp

    from tests.gpu.ranks import abort_and_reform

    with tempfile.TemporaryDirectory() as out:
        ctx = mp.get_context("spawn")
        ports = [free_port(), free_port()]
        procs = [ctx.Process(target=abort_and_reform, args=(r, 2, ports, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(240)
            assert not p.is_alive(), "a rank hung"
        res = pickle.loads(Path(out, "0.pkl").read_bytes())
    assert "traceback" not in res, res.get("traceback")
    assert res["nccl"] and res["env"] == "2", res
    assert res["gen0_ok"], res
    assert res["gen0_error"] is not None, "the collective with a dead peer must fail, not hang or pass"
    assert res["gen0_unblocked_s"] < 60, res  # the abort (2 s grace) or the 10 s timeout, not a hang
    assert res["left"] and res["gen1_ok"], res
