"""The placement of every parameter for the main layouts at world 8-64, in one process.

The fake process group (`FakeStore`, backend "fake") lets one process play any rank of any
world size: the Trainer builds its mesh, stages and shards without talking to anyone. Each
parameter's mesh, placements, local shape and (with pp) presence on the rank are checked
against the rules the layouts are meant to follow, written out here independently.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from parallel.config import EngineConfig
from parallel.pp import layers_per_stage, num_virtual_stages, stage_ids
from parallel.trainer import Trainer

DIM0_TP = ("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight", "output.weight", "tok_embeddings.weight")
DIM1_TP = ("wo.weight", "w2.weight")

LAYOUTS: list[dict[str, Any]] = [
    dict(name="fsdp8", world=8, ranks=[0, 7], parallelism={}),
    dict(name="hsdp2x2-tp2", world=8, ranks=[0, 7], parallelism={"dp_replicate": 2, "tp": 2}),
    dict(name="pp2-fsdp2-tp2-interleaved", world=8, ranks=[0, 5],
         parallelism={"pp": 2, "tp": 2, "pp_schedule": "interleaved_1f1b", "pp_microbatches": 4}),
    dict(name="pp2-fsdp4-zbv", world=8, ranks=[0, 6],
         parallelism={"pp": 2, "pp_schedule": "zbv", "pp_stages_per_rank": 2, "pp_microbatches": 4}),
    dict(name="moe-fsdp4-cp2-ep4", world=8, ranks=[3], moe=8, parallelism={"cp": 2, "ep": 4}),
    dict(name="pp2-cp2-tp4-fsdp4", world=64, ranks=[0, 63], model="debug",
         parallelism={"pp": 2, "cp": 2, "tp": 4, "pp_microbatches": 4}),
    dict(name="moe-hsdp2x8-cp2-ep8", world=32, ranks=[17], moe=16,
         parallelism={"dp_replicate": 2, "cp": 2, "ep": 8}),
]


def _build(lay: dict[str, Any], rank: int) -> Trainer:
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=lay["world"])
    model: dict[str, Any] = {"preset": lay.get("model", "tiny"), "n_layers": 4}
    if "moe" in lay:
        model = {"preset": "mixtral-tiny", "moe": {"num_experts": lay["moe"], "top_k": 2}}
    cfg = EngineConfig.model_validate({
        "model": model, "parallelism": lay["parallelism"],
        "training": {"global_batch_size": 64, "seq_len": 32, "steps": 1, "warmup_steps": 0},
    })
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Trainer(cfg, device=torch.device("cpu"))


def _expected_names(t: Trainer, rank: int) -> set[str]:
    """Parameters this rank must hold: all of them, or with pp only its stages' (global names)."""
    from parallel.model import build_model

    names = {n for n, _ in build_model(t.cfg.model).named_parameters()}
    if not t.dims.pp_enabled:
        return names
    p = t.cfg.parallelism
    v = num_virtual_stages(p)
    counts = layers_per_stage(t.cfg.model.n_layers, p.pp * v, p.pp_split)
    pp_rank = rank // (t.dims.world_size // p.pp)  # pp is the outermost mesh dim
    keep: set[str] = set()
    for s in stage_ids(p.pp_schedule, pp_rank, p.pp, v):
        first = sum(counts[:s])
        keep |= {n for n in names if n.startswith("layers.") and first <= int(n.split(".")[1]) < first + counts[s]}
        if s == 0:
            keep.add("tok_embeddings.weight")
        if s == p.pp * v - 1:
            keep |= {"norm.weight", "output.weight"}
    return keep


def _check_param(t: Trainer, name: str, p: torch.Tensor) -> None:
    d = t.dims
    assert isinstance(p, DTensor), f"{name} is not sharded"
    names = p.device_mesh.mesh_dim_names
    places = tuple(p.placements)
    expert = ".experts." in name
    rep = ("dp_replicate",) if d.dp_replicate > 1 else ()
    rep_p = (Replicate(),) if d.dp_replicate > 1 else ()
    if expert:
        # Experts: whole experts per ep rank (dim 0), FSDP over the data ranks outside ep.
        want_names = (*rep, "dp_shard_mod_ep", "ep")
        fsdp = _StridedShard(0, split_factor=d.ep) if d.dp_shard_mod_ep > 1 else Shard(0)
        want = (*rep_p, fsdp, Shard(0))
        n_shards_dim0 = d.ep * d.dp_shard_mod_ep
    else:
        tp_p: tuple[Any, ...] = ()
        if d.tp > 1:
            tp_p = (Shard(0),) if name.endswith(DIM0_TP) else (Shard(1),) if name.endswith(DIM1_TP) else (Replicate(),)
        tp_dim0 = d.tp > 1 and tp_p[0] == Shard(0)
        fsdp = _StridedShard(0, split_factor=d.tp) if tp_dim0 else Shard(0)
        want_names = (*rep, "dp_shard_cp", *(("tp",) if d.tp > 1 else ()))
        want = (*rep_p, fsdp, *tp_p)
        n_shards_dim0 = d.dp_shard * d.cp * (d.tp if tp_dim0 else 1)
    assert names == want_names, f"{name}: mesh {names} != {want_names}"
    assert places == want, f"{name}: placements {places} != {want}"
    local = p.to_local().shape
    rows = math.ceil(p.shape[0] / n_shards_dim0)
    assert local[0] <= rows, f"{name}: local dim 0 {local[0]} > ceil({p.shape[0]}/{n_shards_dim0})"
    if d.tp > 1 and not expert and name.endswith(DIM1_TP):
        assert local[1] == p.shape[1] // d.tp, f"{name}: tp must split dim 1"


@pytest.mark.parametrize("lay", LAYOUTS, ids=[lay["name"] for lay in LAYOUTS])
def test_every_parameter_is_placed_by_the_plan(lay: dict[str, Any]) -> None:
    try:
        for rank in lay["ranks"]:
            t = _build(lay, rank)
            got = dict(t.model.named_parameters())
            assert set(got) == _expected_names(t, rank), f"rank {rank} holds the wrong parameters"
            for name, p in got.items():
                _check_param(t, name, p)
            if t.cfg.model.moe is not None:
                n_local = t.cfg.model.moe.num_experts // (t.dims.ep * t.dims.dp_shard_mod_ep)
                w1 = next(p for n, p in got.items() if n.endswith("experts.w1"))
                assert w1.to_local().shape[0] == n_local
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
