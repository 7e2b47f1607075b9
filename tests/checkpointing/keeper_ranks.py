"""A training rank as a Ray actor, for the keeper tests: the test driver runs phases on 2-4 of them.

Each phase joins a fresh gloo group (new store port), as elastic recovery re-forms in the same
processes, builds the engine's Trainer (FSDP over the phase's world), and leaves the group after.
Rank 0 of a phase does the comparisons (full gathered state, losses) and raises on a mismatch.
"""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from checkpointing.config import CheckpointConfig
from checkpointing.persistent import CheckpointManager
from checkpointing.snapshot import SnapshotClient, SnapshotLost, restore_from_keepers, restore_with_fallback
from checkpointing.state import flatten, gather_full
from parallel.config import EngineConfig

GLOBAL_BATCH, SEQ, STEPS = 12, 16, 12  # 12 divides evenly at dp 2, 3 and 4


def engine_cfg(init_seed: int) -> EngineConfig:
    return EngineConfig.model_validate({
        "model": {"preset": "tiny", "init_seed": init_seed},
        "training": {"steps": STEPS, "seq_len": SEQ, "global_batch_size": GLOBAL_BATCH, "warmup_steps": 2,
                     "lr": 1e-2},
        "parallelism": {"dp_shard": -1},
    })  # fmt: skip


def compare(ref: dict[str, Any], got: dict[str, Any], what: str) -> None:
    assert set(ref) == set(got), f"{what}: keys differ: {sorted(set(ref) ^ set(got))[:10]}"
    for k, a in ref.items():
        b = got[k]
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, f"{what}: {k}"
            assert torch.equal(a, b), f"{what}: {k} differs by {(a.float() - b.float()).abs().max()}"
        else:
            assert a == b, f"{what}: {k}: {a!r} != {b!r}"


class RankActor:
    def __init__(self, workdir: str) -> None:
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"
        self.workdir = Path(workdir)

    def node(self) -> str:
        from service.local_cluster import node_name_of_current_process

        name = node_name_of_current_process()
        assert name is not None
        return name

    def _join(self, rank: int, world: int, port: int) -> None:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=120),
                              wait_for_workers=False)  # fmt: skip
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120)
        )

    def _full(self, trainer: Any) -> dict[str, Any]:
        return flatten(gather_full(trainer.state_dict()))

    def save_phase(
        self, rank: int, world: int, port: int, job_id: str, keepers: dict[str, Any], ckpt_uri: str,
        snap_steps: int,
    ) -> dict[str, Any]:  # fmt: skip
        """Train STEPS steps at `world`; snapshot steps 1..snap_steps; persist step 2; save references."""
        from parallel.trainer import Trainer

        self._join(rank, world, port)
        trainer = Trainer(engine_cfg(0), device=torch.device("cpu"))
        client = SnapshotClient(job_id, rank, world, self.node(), keepers, optimizer=trainer.optimizer)
        mgr = CheckpointManager(
            CheckpointConfig(uri=ckpt_uri, keep_last=2), "unused", rank=rank, world_size=world
        )
        handles, losses = [], []
        for s in range(1, STEPS + 1):
            losses.append(trainer.train_step().loss)
            if s <= snap_steps:
                handles.append(client.snapshot(trainer.state_dict(), trainer.step, generation=0))
            if s == 2:
                res = mgr.save(trainer.state_dict(), trainer.step, generation=0, layout={"dp_shard": world})
                assert res.ok, res.error
            if s in (2, snap_steps):
                full = self._full(trainer)
                if rank == 0:
                    torch.save(full, self.workdir / f"ref_step{s}.pt")
        results = [h.result(timeout=120) for h in handles]
        mgr.close()
        client.close()
        dist.destroy_process_group()
        return {"losses": losses, "results": [dataclasses.asdict(r) for r in results]}

    def restore_phase(
        self, rank: int, world: int, port: int, job_id: str, keepers: dict[str, Any], ckpt_uri: str,
        losses: list[float], expect_lost: bool,
    ) -> dict[str, Any]:  # fmt: skip
        """Fresh Trainer (other weights) at `world`; restore; compare state and the next 4 losses."""
        from parallel.trainer import Trainer

        self._join(rank, world, port)
        trainer = Trainer(engine_cfg(42), device=torch.device("cpu"))  # other weights: all must be restored
        state = trainer.state_dict()  # built for this mesh
        out: dict[str, Any] = {}
        if expect_lost:
            try:
                restore_from_keepers(keepers, job_id, state)
                raise AssertionError("restore_from_keepers should have raised SnapshotLost")
            except SnapshotLost as e:
                out["lost"] = str(e)
            mgr = CheckpointManager(CheckpointConfig(uri=ckpt_uri), "unused", rank=rank, world_size=world)
            info = restore_with_fallback(keepers, job_id, state, mgr, prefer_node=self.node())
            mgr.close()
        else:
            info = restore_from_keepers(keepers, job_id, state, prefer_node=self.node())
        trainer.load_state_dict(state)
        assert trainer.step == info.step
        got = self._full(trainer)
        after = [trainer.train_step().loss for _ in range(4)]
        if rank == 0:
            ref = torch.load(self.workdir / f"ref_step{info.step}.pt", weights_only=False)
            compare(ref, got, f"snapshot step {info.step} restored at world {world} from {info.source}")
            expect = losses[info.step : info.step + 4]
            diff = max(abs(a - b) for a, b in zip(after, expect, strict=True))
            assert diff <= 1e-5, f"world {world}: losses {after} vs uninterrupted {expect}"
            out["loss_diff"] = diff
            out["entries"] = len(got)
        dist.destroy_process_group()
        out["info"] = dataclasses.asdict(info)
        return out
