"""Rank program: save at world 4, restore at worlds 2, 3 and 4 in the same processes.

Layouts (built with torch directly): "fsdp" (FSDP2 over all ranks) saved to S3 (SeaweedFS), and
"fsdp_tp" (FSDP2 over dp x TP 2 with parallelize_module) saved to file://. For each layout:
  save phase (world 4): train 2 steps, gather the full state (reference), save_async, train step 3
  while the upload runs (so the staged copy must be isolated), record step 3's loss, wait.
  restore phases (world 2, 3, 4; TP layouts only where 2 divides the world): build a fresh model
  with other init weights, latest_valid(), load with resharding, compare the full gathered state with
  the reference exactly, then train step 3 from it and compare the loss with the uninterrupted one.
Then the same with the engine's Trainer (to S3): save at step 5 of a world-4 run while it goes on to
step 15; FSDP 4 restored at worlds 2 and 3, FSDP 2 x TP 2 (the engine's apply_tp: sequence and loss
parallel) restored at world 2 (dp 1 x tp 2): the next 10 losses match the uninterrupted run (batch
invariance makes them dp-independent). Ranks not in a phase's world sit it out; every phase forms a new group on a new store port, the way
elastic recovery re-forms in the same processes.
"""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from checkpointing.config import CheckpointConfig, S3Config
from checkpointing.persistent import CheckpointManager
from checkpointing.state import flatten, gather_full
from parallel.config import ModelConfig
from parallel.model import build_model, init_weights

MODEL = ModelConfig(preset="tiny")
GLOBAL_BATCH, SEQ = 12, 16  # 12 divides evenly at dp 1, 2, 3, 4


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, MODEL.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=g)


def build(layout: str, world: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, DeviceMesh]:
    model = build_model(MODEL, "meta")
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        dp_mesh = mesh
    else:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        dp_mesh = mesh["dp"]
        plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel()}  # fmt: skip
        for block in model.layers.values():
            parallelize_module(block, mesh["tp"], plan)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    init_weights(model, MODEL, seed=seed, device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt, mesh


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, mesh: DeviceMesh, step: int) -> float:
    dp_mesh = mesh["dp"] if mesh.ndim > 1 else mesh
    dp, r = dp_mesh.size(), dp_mesh.get_local_rank()
    per = GLOBAL_BATCH // dp
    tokens = batch(step)[r * per : (r + 1) * per]
    logits = model(tokens[:, :-1])
    local_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1), reduction="sum"
    )
    n_global = GLOBAL_BATCH * SEQ
    (local_sum / n_global * dp).backward()  # FSDP averages over dp: scale back to a global-token mean
    opt.step()
    opt.zero_grad()
    total = local_sum.detach().clone()
    dist.all_reduce(total, group=dp_mesh.get_group())
    return float(total) / n_global


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer, extra: dict[str, Any]) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return flatten(gather_full({"model": msd, "optim": osd, **extra}))


def cfg_for(layout: str, workdir: Path) -> CheckpointConfig:
    if layout == "fsdp" or layout.startswith("trainer"):
        s3 = S3Config(endpoint_url=os.environ["UB_S3_ENDPOINT"], region="us-east-1",
                      access_key_id=os.environ["UB_S3_KEY"], secret_access_key=os.environ["UB_S3_SECRET"],
                      part_size_mb=5, max_concurrency=4)  # fmt: skip
        return CheckpointConfig(uri=f"s3://{os.environ['UB_S3_BUCKET']}/{layout}", s3=s3, keep_last=2)
    return CheckpointConfig(uri=f"file://{workdir / 'ckpt_tp'}", keep_last=2)


_BASE: list[dist.TCPStore] = []  # one store server for every group this run forms: no second port to race for


def join(rank: int, world: int, port: int, name: str) -> None:
    if not _BASE:
        _BASE.append(dist.TCPStore("127.0.0.1", port, None, is_master=rank == 0, timeout=timedelta(seconds=300),
                                   wait_for_workers=False))  # fmt: skip
    store = dist.PrefixStore(name, _BASE[0])
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    # A re-formed group's meshes equal the old ones: DTensor's caches must not hand back the dead mesh.
    from parallel.dist import reset_dtensor_caches

    reset_dtensor_caches()


def compare(ref: dict[str, Any], got: dict[str, Any], what: str) -> None:
    assert set(ref) == set(got), f"{what}: keys differ: {sorted(set(ref) ^ set(got))[:10]}"
    for k, a in ref.items():
        b = got[k]
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, f"{what}: {k}"
            assert torch.equal(a, b), f"{what}: {k} differs by {(a.float() - b.float()).abs().max()}"
        else:
            assert a == b, f"{what}: {k}: {a!r} != {b!r}"


TRAIN_STEPS = 15


def engine_cfg(init_seed: int, tp: int) -> Any:
    from parallel.config import EngineConfig

    return EngineConfig.model_validate({
        "model": {"preset": "tiny", "init_seed": init_seed},
        "training": {"steps": TRAIN_STEPS, "seq_len": SEQ, "global_batch_size": GLOBAL_BATCH, "warmup_steps": 2,
                     "lr": 1e-2},
        "parallelism": {"dp_shard": -1, "tp": tp},
    })  # fmt: skip


def trainer_save(rank: int, world: int, workdir: Path, tp: int) -> None:
    from parallel.trainer import Trainer

    trainer = Trainer(engine_cfg(0, tp), device=torch.device("cpu"))
    for _ in range(5):
        trainer.train_step()
    mgr = CheckpointManager(cfg_for(f"trainer-tp{tp}", workdir), "unused", rank=rank, world_size=world)
    handle = mgr.save_async(
        trainer.state_dict(),
        trainer.step,
        generation=0,
        layout={"dp_shard": world // tp, "tp": tp},
        optimizer=trainer.optimizer if tp == 1 else None,  # both staging modes
    )
    losses = [trainer.train_step().loss for _ in range(TRAIN_STEPS - 5)]  # while the upload runs
    res = handle.result()
    assert res.ok, res.error
    mgr.close()
    if rank == 0:
        torch.save(losses, workdir / f"trainer_tp{tp}_losses.pt")


def trainer_restore(rank: int, world: int, workdir: Path, tp: int) -> None:
    from parallel.trainer import Trainer

    trainer = Trainer(engine_cfg(42, tp), device=torch.device("cpu"))  # other weights: all from disk
    mgr = CheckpointManager(cfg_for(f"trainer-tp{tp}", workdir), "unused", rank=rank, world_size=world)
    state = trainer.state_dict()  # built for this mesh, fresh optimizer state included
    info = mgr.latest_valid()
    assert info is not None and info.step == 5, (info, mgr.skipped)
    mgr.load(state, info)
    trainer.load_state_dict(state)
    assert trainer.step == 5
    losses = [trainer.train_step().loss for _ in range(TRAIN_STEPS - 5)]
    mgr.close()
    if rank == 0:
        ref = torch.load(workdir / f"trainer_tp{tp}_losses.pt")
        diff = max(abs(a - b) for a, b in zip(ref, losses, strict=True))
        assert diff <= 1e-4, f"world {world}: losses {losses} vs uninterrupted {ref}"
        print(
            f"OK trainer tp{tp} 4->{world}: 10 steps match the uninterrupted run (max diff {diff:.2e})",
            flush=True,
        )


def main() -> None:
    rank, world0, port = (
        int(os.environ["RANK"]),
        int(os.environ["WORLD_SIZE"]),
        int(os.environ["MASTER_PORT"]),
    )
    workdir = Path(sys.argv[1])
    torch.manual_seed(0)
    layouts = ["fsdp", "fsdp_tp"]

    # ---- save at world 4
    join(rank, world0, port, "save")
    for layout in layouts:
        model, opt, mesh = build(layout, world0, seed=0)
        for s in (1, 2):
            train_step(model, opt, mesh, s)
        ref = full_state(model, opt, {"step": 2})
        mgr = CheckpointManager(cfg_for(layout, workdir), "unused", rank=rank, world_size=world0)
        msd, osd = get_state_dict(model, opt)
        first = mgr.save_async(
            {"model": msd, "optim": osd, "step": 1}, step=1, generation=0, layout={"dp": 4}
        )
        assert first.result().ok, first.result().error
        handle = mgr.save_async({"model": msd, "optim": osd, "step": 2}, step=2, generation=0,
                                layout={"layout": layout, "world": world0}, optimizer=opt)  # fmt: skip
        loss3 = train_step(model, opt, mesh, 3)  # mutates params/optimizer while the upload runs
        res = handle.result()
        assert res.ok, res.error
        mgr.close()
        if rank == 0:
            torch.save({"ref": ref, "loss3": loss3}, workdir / f"ref_{layout}.pt")
        del model, opt
    for tp in (1, 2):
        trainer_save(rank, world0, workdir, tp)
    dist.barrier()
    dist.destroy_process_group()

    # ---- restore at other world sizes
    for i, world in enumerate((2, 3, 4)):
        if rank < world:
            join(rank, world, port, f"restore{i}")
            for layout in layouts:
                if layout == "fsdp_tp" and world % 2:
                    continue
                model, opt, mesh = build(layout, world, seed=123)  # other weights: all must come from disk
                msd, osd = get_state_dict(model, opt)  # on the fresh optimizer, before loading
                state = {"model": msd, "optim": osd, "step": 0}
                mgr = CheckpointManager(cfg_for(layout, workdir), "unused", rank=rank, world_size=world)
                info = mgr.latest_valid()
                assert info is not None and info.step == 2, (info, mgr.skipped)
                assert info.layout == {"layout": layout, "world": 4} and info.world_size == 4
                mgr.load(state, info)
                set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
                got = full_state(model, opt, {"step": state["step"]})
                loss3 = train_step(model, opt, mesh, 3)
                mgr.close()
                if rank == 0:
                    saved = torch.load(workdir / f"ref_{layout}.pt", weights_only=False)
                    compare(saved["ref"], got, f"{layout} saved at world 4, restored at world {world}")
                    assert abs(loss3 - saved["loss3"]) < 1e-5, (layout, world, loss3, saved["loss3"])
                    print(f"OK {layout} 4->{world}: {len(got)} entries equal; step-3 loss "
                          f"{loss3:.6f} vs {saved['loss3']:.6f}", flush=True)  # fmt: skip
                del model, opt
            if world < 4:
                trainer_restore(rank, world, workdir, tp=1)
            if world == 2:
                trainer_restore(rank, world, workdir, tp=2)
            dist.barrier()
            dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
