"""4 plain gloo ranks (tests.checkpointing.harness): the snapshot layout of replicated layouts.

For HSDP 2 x 2, DDP-like 4 x 1 (dp_replicate x dp_shard) and FSDP 2 x TP 2, after two steps each rank plans and
stages its snapshot shard as the SnapshotClient does (StagingPlan, slot views, extras), and every
rank's layout and blob are gathered to all. Checked: every element of every DTensor entry is stored
exactly once across the ranks (the replicas split it), where a rank without the split stored its
replica's whole copy; then a fresh Trainer with other weights, at FSDP over 4 (another layout) and at
the saved layout, loads the snapshot through the keepers' reader (KeeperReader over the gathered
blobs): its full gathered state equals the saved one, bit for bit.
"""

from __future__ import annotations

import os
import pickle
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from checkpointing.memory_storage import (
    KeeperReader,
    ShardLayout,
    StagingPlan,
    build_metadata,
    flatten,
    pack_extras,
    slot_views,
)
from checkpointing.state import flatten as flatten_full
from checkpointing.state import gather_full
from parallel.config import EngineConfig
from parallel.trainer import Trainer
from tests.checkpointing.keeper_ranks import compare

LAYOUTS = {
    "hsdp 2x2": {"dp_replicate": 2, "dp_shard": 2},
    "replicate 4": {"dp_replicate": 4, "dp_shard": 1},
    "fsdp 2 x tp 2": {"dp_shard": 2, "tp": 2},  # the norms are replicated over tp
}


def engine(par: dict[str, Any], init_seed: int) -> EngineConfig:
    return EngineConfig.model_validate({
        "model": {"preset": "tiny", "init_seed": init_seed},
        "training": {"steps": 4, "seq_len": 16, "global_batch_size": 8, "warmup_steps": 1, "lr": 1e-2},
        "parallelism": par,
    })  # fmt: skip


def stage(trainer: Trainer) -> tuple[bytes, bytes, bytes, int]:
    """(layout, blob, extras, the bytes this rank's DTensor entries would be without the split)."""
    state = trainer.state_dict()
    flat, _ = flatten(state)
    plan = StagingPlan()
    plan.update(state, flat)
    layout = plan.layout
    assert layout is not None
    blob = torch.zeros(max(layout.total_bytes, 1), dtype=torch.uint8)
    for view, src in zip(slot_views(blob, layout), plan.sources, strict=True):
        view.copy_(src)
    whole = sum(v._local_tensor.numel() * v.element_size() for v in flat.values() if isinstance(v, DTensor))
    return layout.to_bytes(), blob.numpy().tobytes(), pack_extras(flat, layout), whole


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))  # fmt: skip
    torch.manual_seed(0)
    for name, par in LAYOUTS.items():
        trainer = Trainer(engine(par, 1), device=torch.device("cpu"))
        for _ in range(2):
            trainer.train_step()
        saved = flatten_full(gather_full(trainer.state_dict()))
        mine = stage(trainer)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        layouts = {r: ShardLayout.from_bytes(g[0]) for r, g in enumerate(gathered)}
        flat, _ = flatten(trainer.state_dict())
        dtensors = {k: v for k, v in flat.items() if isinstance(v, DTensor)}
        stored: dict[str, int] = {}
        for lay in layouts.values():
            for s in lay.slots:
                fqn = lay.items[s.item].index.fqn
                if fqn in dtensors:
                    stored[fqn] = stored.get(fqn, 0) + s.nbytes
        for fqn, v in dtensors.items():
            assert stored.get(fqn, 0) == v.numel() * v.element_size(), (name, fqn, stored.get(fqn), v.shape)
        split = sum(stored.values())
        unsplit = sum(g[3] for g in gathered)
        if "tp" in par:  # only some tensors are replicated
            assert split < unsplit, (name, split, unsplit)
        else:
            assert unsplit == par["dp_replicate"] * split, (name, unsplit, split)
        blobs = {r: g[1] for r, g in enumerate(gathered)}
        extras = {r: pickle.loads(g[2]) for r, g in enumerate(gathered)}
        metadata, where = build_metadata(layouts)
        for target in ({"dp_shard": 4}, par):
            fresh = Trainer(engine(target, 2), device=torch.device("cpu"))
            state = fresh.state_dict()
            read: set[int] = set()

            def fetch(ranks: list[int], blobs: dict[int, bytes] = blobs, read: set[int] = read) -> Any:
                for r in ranks:
                    read.add(r)
                    yield r, np.frombuffer(blobs[r], dtype=np.uint8)

            dcp.load(state, storage_reader=KeeperReader(metadata, where, extras, fetch), no_dist=True)
            fresh.load_state_dict(state)
            got = flatten_full(gather_full(fresh.state_dict()))
            compare(saved, got, f"{name} -> {target}")
            assert fresh.step == trainer.step
            if rank == 0:
                print(f"OK {name} -> {target}: restored equal; stored {split} bytes of DTensors over the "
                      f"ranks against {unsplit} unsplit; rank 0 read ranks {sorted(read)}", flush=True)
            del fresh
        del trainer
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
