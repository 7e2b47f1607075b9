"""The CUDA snapshot path and parity on one GPU (skipped without CUDA; `pytest -m gpu tests/gpu`).

- parity: the engine's losses on the GPU match the CPU's over 6 steps (fp32).
- in-memory snapshot, overlapped: after step s the copy goes to a pinned buffer on a side stream while
  step s+1 runs at once; the optimizer step of s+1 waits for it on the GPU. Restoring the committed
  snapshot into a fresh Trainer gives exactly the state of step s, and the next losses match.
- persistent tier: save_async with the optimizer (side-stream staging after an event recorded on the
  training stream) while the next step runs; loading it gives the state of the saved step.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

JOB = "gpu-snapshot"


def _cfg() -> Any:
    from parallel.config import EngineConfig

    return EngineConfig.model_validate({
        "model": {"preset": "debug", "init_seed": 0},
        "training": {"steps": 20, "seq_len": 64, "global_batch_size": 4, "warmup_steps": 2},
    })  # fmt: skip


def _trainer(device: str) -> Any:
    from parallel.trainer import Trainer

    return Trainer(_cfg(), device=torch.device(device))


def _full(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    from checkpointing.state import flatten, gather_full

    return {k: v for k, v in flatten(gather_full(state)).items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module")
def keepers() -> Iterator[dict[str, Any]]:
    from checkpointing.keepers import ensure_keepers, kill_keepers
    from service.local_cluster import LocalCluster

    with LocalCluster(head_cpus=2) as cluster:
        cluster.connect()
        ks = ensure_keepers(["head"], memory_limit_mb=1024)
        try:
            yield ks
        finally:
            kill_keepers(ks)


def test_gpu_losses_match_cpu() -> None:
    cpu, gpu = _trainer("cpu"), _trainer("cuda")
    for _ in range(6):
        a, b = cpu.train_step().loss, gpu.train_step().loss
        assert abs(a - b) <= 1e-4, (a, b)


def test_overlapped_cuda_snapshot_is_the_state_of_its_step(keepers: dict[str, Any]) -> None:
    from checkpointing.keepers import commit_snapshot
    from checkpointing.snapshot import SnapshotClient, restore_from_keepers

    tr = _trainer("cuda")
    for _ in range(3):
        tr.train_step()
    client = SnapshotClient(JOB, 0, 1, "head", keepers, optimizer=tr.optimizer)
    assert client.overlapped
    expected = _full(tr.state_dict())
    handle = client.snapshot(tr.state_dict(), tr.step, 0)
    nxt = [tr.train_step().loss for _ in range(2)]  # at once: its optimizer step waits on the GPU
    res = handle.result(timeout=120)
    assert res.ok, res
    assert client._buffers and all(b.data.is_pinned() for b in client._buffers)
    client.close()
    assert commit_snapshot(keepers, JOB, 0, 3, 1)
    fresh = _trainer("cuda")
    state = fresh.state_dict()
    restore_from_keepers(keepers, JOB, state, step=3)
    fresh.load_state_dict(state)
    got = _full(fresh.state_dict())
    for k, v in expected.items():
        assert torch.equal(got[k].cpu(), v.cpu()), k
    assert [fresh.train_step().loss for _ in range(2)] == pytest.approx(nxt, abs=1e-6)


def test_persistent_save_with_optimizer_on_cuda(tmp_path: Path) -> None:
    from checkpointing.config import CheckpointConfig
    from checkpointing.persistent import CheckpointManager

    tr = _trainer("cuda")
    for _ in range(2):
        tr.train_step()
    mgr = CheckpointManager(CheckpointConfig(), tmp_path.as_uri(), rank=0, world_size=1)
    expected = _full(tr.state_dict())
    handle = mgr.save_async(tr.state_dict(), tr.step, 0, {"dp": 1}, optimizer=tr.optimizer)
    tr.train_step()  # the copy is staged beside this step; its optimizer step waits for it
    assert handle.result(timeout=120).ok
    assert mgr.staging_bytes > 0
    mgr.close()
    fresh = _trainer("cuda")
    state = fresh.state_dict()
    info = mgr.latest_valid()
    assert info is not None and info.step == 2
    mgr.load(state, info)
    fresh.load_state_dict(state)
    got = _full(fresh.state_dict())
    for k, v in expected.items():
        assert torch.equal(got[k].cpu(), v.cpu()), k
