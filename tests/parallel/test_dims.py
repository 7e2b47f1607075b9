"""ParallelDims: sizes, validation messages, and the mesh's named and flattened dims."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from parallel.config import ModelConfig, ParallelConfig, TrainConfig
from parallel.dims import ParallelDims, ParallelDimsError


def dims(world: int, **kw: int) -> ParallelDims:
    base = dict(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1)
    return ParallelDims(**{**base, **kw}, world_size=world)


@pytest.mark.parametrize(
    ("world", "sizes", "expected"),
    [
        (4, {}, dict(dp_shard=4, dp=4, fsdp_size=4)),
        (8, {"tp": 2}, dict(dp_shard=4, dp=4, fsdp_size=4)),
        (8, {"dp_replicate": 2, "tp": 2}, dict(dp_shard=2, dp=4, fsdp_size=4)),
        (8, {"cp": 2}, dict(dp_shard=4, dp=4, fsdp_size=8, dp_cp=8)),
        (8, {"pp": 2, "tp": 2}, dict(dp_shard=2, dp=2, fsdp_size=2)),
        (1, {}, dict(dp_shard=1, dp=1, fsdp_size=1)),
        (8, {"ep": 4, "cp": 2}, dict(dp_shard=4, dp_shard_in_ep=2, dp_shard_mod_ep=2)),
    ],
)
def test_sizes(world: int, sizes: dict[str, int], expected: dict[str, int]) -> None:
    d = dims(world, **sizes)
    for name, value in expected.items():
        assert getattr(d, name) == value, name


@pytest.mark.parametrize(
    ("world", "sizes", "message"),
    [
        (4, {"dp_shard": 3, "tp": 2}, "dp_replicate*dp_shard*cp*tp*pp=6 != world_size=4"),
        (4, {"tp": 3}, "dp_replicate*cp*tp*pp=3 does not divide world_size=4"),
        (6, {"dp_shard": 2, "tp": 2}, "dp_replicate*dp_shard*cp*tp*pp=4 != world_size=6"),
        (4, {"dp_shard": 0}, "dp_shard=0 must be a positive integer or -1"),
        (4, {"tp": 0}, "tp=0 must be a positive integer"),
        (6, {"ep": 4}, "ep=4 does not divide dp_shard*cp=6"),
        (8, {"ep": 2, "cp": 4, "dp_shard": 2}, "cp=4 does not divide ep=2"),
    ],
)
def test_size_errors(world: int, sizes: dict[str, int], message: str) -> None:
    with pytest.raises(ParallelDimsError, match=message.replace("*", r"\*")):
        dims(world, **sizes)


TINY: dict[str, Any] = dict(preset="tiny")  # dim 64, 4 heads, 2 kv heads, ffn 176, vocab 256


@pytest.mark.parametrize(
    ("world", "sizes", "model", "train", "message"),
    [
        (4, {"tp": 4}, {"n_kv_heads": 2}, {}, "tp=4 does not divide n_kv_heads=2"),
        (3, {"tp": 3}, {}, {}, "tp=3 does not divide n_heads=4"),
        (2, {"tp": 2}, {"hidden_dim": 177}, {}, "tp=2 does not divide ffn dim (hidden_dim)=177"),
        (2, {"tp": 2}, {"vocab_size": 255}, {}, "tp=2 does not divide vocab_size=255"),
        (2, {"cp": 2}, {}, {"seq_len": 6}, "cp*2=4 does not divide training.seq_len=6"),
        (2, {"ep": 2}, {}, {}, "ep=2 needs a mixture-of-experts model"),
        (4, {"ep": 4}, {"moe": {"num_experts": 6}}, {}, "ep=4 does not divide moe.num_experts=6"),
        (4, {"pp": 4}, {"n_layers": 2}, {}, "pp stages=4 exceed n_layers=2"),
        (8, {}, {}, {"global_batch_size": 4}, "global_batch_size=4 is smaller than dp=8"),
        (1, {}, {"max_seq_len": 16}, {"seq_len": 32}, "training.seq_len=32 exceeds model.max_seq_len=16"),
    ],
)
def test_validate_errors(
    world: int, sizes: dict[str, int], model: dict[str, Any], train: dict[str, Any], message: str
) -> None:
    d = dims(world, **sizes)
    with pytest.raises(ParallelDimsError) as err:
        d.validate(ModelConfig(**{**TINY, **model}), TrainConfig(**train))
    assert message in str(err.value)


def test_validate_accepts_good_layouts() -> None:
    m, t = ModelConfig(**TINY), TrainConfig(global_batch_size=8, seq_len=32)
    for world, sizes in [(1, {}), (2, {"tp": 2}), (8, {"dp_replicate": 2, "tp": 2}), (4, {"cp": 2}),
                         (8, {"pp": 2, "tp": 2})]:
        dims(world, **sizes).validate(m, t)


def test_validate_reports_every_problem_at_once() -> None:
    with pytest.raises(ParallelDimsError) as err:
        dims(8, tp=4, cp=2).validate(ModelConfig(**TINY), TrainConfig(seq_len=6))
    assert "n_kv_heads" in str(err.value) and "training.seq_len=6" in str(err.value)


def test_auto_must_be_resolved_first() -> None:
    with pytest.raises(ParallelDimsError, match="parallelism: auto"):
        ParallelDims.from_config(ParallelConfig.model_validate("auto"), 4)


@pytest.fixture
def fake_world() -> Any:
    """A world of 8 simulated in one process (the fake backend runs no collectives)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(world: int, rank: int = 0) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("sizes", "rank", "expected", "absent"),
    [
        # HSDP 2x2 with tp 2: tp innermost, so rank 5 = (rep 1, shard 0, tp 1).
        ({"dp_replicate": 2, "tp": 2}, 5,
         {"tp": 2, "dp": 4, "dp_shard_cp": 2, "dp_cp": 4, "dp_replicate": 2}, ["pp", "cp"]),
        ({"cp": 2, "tp": 2}, 3, {"tp": 2, "cp": 2, "dp": 2, "dp_shard_cp": 4, "dp_cp": 4}, ["pp", "dp_replicate"]),
        ({"pp": 2}, 6, {"pp": 2, "dp": 4, "dp_shard": 4}, ["tp", "cp", "dp_replicate"]),
        ({"ep": 4, "cp": 2}, 1, {"ep": 4, "dp_shard": 4, "dp_shard_cp": 8, "dp": 4, "dp_shard_in_ep": 2,
                                 "dp_shard_mod_ep": 2}, ["tp", "pp"]),
        # HSDP without sharding keeps its size-1 shard dim: FSDP's mesh is 2-D under HSDP.
        ({"dp_replicate": 4, "tp": 2}, 2, {"dp_replicate": 4, "dp_shard": 1, "dp_shard_cp": 1, "dp": 4}, ["cp"]),
        ({"tp": 8}, 3, {"tp": 8}, ["dp", "dp_cp", "dp_shard_cp", "dp_shard"]),
    ],
)
def test_mesh_names_and_sizes(fake_world: Any, sizes: dict[str, int], rank: int, expected: dict[str, int],
                              absent: list[str]) -> None:
    fake_world(8, rank)
    d = dims(8, **sizes)
    mesh = d.build_mesh("cpu")
    assert mesh.mesh_dim_names == d.mesh_dim_names()
    for name, size in expected.items():
        assert d.get_mesh(mesh, name).size() == size, name
    for name in absent:  # size 1: not built, and asking for it says so
        with pytest.raises(KeyError, match=f"no \\['{name}'\\] dimension: only dims of size > 1"):
            d.get_mesh(mesh, name)
    assert 0 <= d.dp_rank(mesh) < d.dp


def test_fsdp_mesh_makes_no_group(fake_world: Any) -> None:
    """A 1-D FSDP layout's mesh and every flattened sub-mesh are the default group: a (re-)form makes
    no process group (the full 5-dim mesh made 4 x world of them, one store barrier each)."""
    fake_world(4, 2)
    d = dims(4)
    mesh = d.build_mesh("cpu")
    assert mesh.mesh_dim_names == ("dp_shard",)
    default = dist.distributed_c10d._get_default_group()
    for name in ("dp_shard", "dp", "dp_shard_cp", "dp_cp"):
        assert d.get_mesh(mesh, name).get_group() is default, name
    assert d.fsdp_mesh(mesh).mesh_dim_names == ("dp_shard_cp",)
    assert d.dp_rank(mesh) == 2


def test_dp_rank_layout(fake_world: Any) -> None:
    # dp rank counts data-parallel slices: with tp=2 innermost, ranks 2k and 2k+1 share a slice.
    fake_world(8, 5)
    d = dims(8, dp_replicate=2, tp=2)
    mesh = d.build_mesh("cpu")
    assert d.dp_rank(mesh) == 2
    assert d.fsdp_mesh(mesh).mesh_dim_names == ("dp_replicate", "dp_shard_cp")


def _tp_sum_mesh(d: ParallelDims) -> tuple[Any, Any]:
    """Build d's mesh and run one DTensor op on its tp dim; returns (tp mesh, the result's mesh)."""
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = d.build_mesh("cpu")
    tp = d.get_mesh(mesh, "tp")
    x = distribute_tensor(torch.ones(4, 4), tp, [Shard(0)])
    return tp, (x + x).device_mesh


def test_reformed_group_gets_no_stale_mesh(fake_world: Any) -> None:
    """A re-formed group's tp mesh equals the old one (same ranks, same name); DTensor's sharding
    cache must not hand back the old mesh, whose process groups are gone. (Without
    `reset_dtensor_caches` in build_mesh the result's mesh is the old one: checked by hand.)"""
    fake_world(4)
    old_tp, _ = _tp_sum_mesh(dims(4, tp=2))
    dist.destroy_process_group()
    fake_world(4)
    new_tp, result_mesh = _tp_sum_mesh(dims(4, tp=2, ep=2))  # another mesh structure, same tp ranks
    assert new_tp == old_tp and new_tp is not old_tp
    assert result_mesh is new_tp
