"""Pipeline parallelism: stage splitting, and every schedule through the Trainer against one process.

One 4-rank launch runs pp=2 with each schedule (ranks 0-1), pp=2 × fsdp=2 with each schedule
(FSDP stages keep parameters gathered after forward, as the zero-bubble schedules need), an
uneven explicit split, and a MoE model (its load-balancing loss crosses stage boundaries on the
gradient of the MoE output); 10 steps each, losses and final weights against one process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from parallel.config import ModelConfig, ParallelConfig
from parallel.model import build_model
from parallel.planner.timing import bubble_fraction
from parallel.pp import (
    SCHEDULES,
    PipelineConfigError,
    layers_per_stage,
    split_model,
    stage_ids,
)
from tests.parallel.layout_parity import check_parity, reference, run_many

STEPS = 10
BASE: dict[str, Any] = {
    "model": {"preset": "tiny", "n_layers": 4},
    "training": {"steps": STEPS, "seq_len": 32, "global_batch_size": 8, "warmup_steps": 2, "lr": 1e-3},
}
MOE_BASE: dict[str, Any] = {
    **BASE,
    "model": {"preset": "mixtral-tiny", "n_layers": 4, "moe": {"num_experts": 4, "aux_loss_coef": 0.1}},
}


def _pp(schedule: str, micro: int = 4, **extra: Any) -> dict[str, Any]:
    v = 1 if schedule in ("gpipe", "1f1b") else 2
    return {"pp": 2, "pp_schedule": schedule, "pp_microbatches": micro, "pp_stages_per_rank": v, **extra}


LAYOUTS: list[dict[str, Any]] = (
    [dict(name=f"pp2-{s}", world=2, parallelism=_pp(s)) for s in SCHEDULES]
    + [dict(name=f"pp2xfsdp2-{s}", world=4, parallelism=_pp(s)) for s in SCHEDULES]
    + [dict(name="pp2-split-1-3-ac", world=2, parallelism=_pp("1f1b", 2, pp_split=[1, 3]),
            training={"activation_checkpointing": "full"})]
)
MOE_LAYOUTS: list[dict[str, Any]] = [
    dict(name="moe-pp2-zbv", world=2, parallelism=_pp("zbv")),
    dict(name="moe-pp2xfsdp2-1f1b", world=4, parallelism=_pp("1f1b", 2)),
]


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    """Dense and MoE layouts in one 4-rank launch (the base config differs, so two bodies)."""
    return run_many([(BASE, LAYOUTS), (MOE_BASE, MOE_LAYOUTS)], 4, timeout_s=600)


@pytest.fixture(scope="module")
def refs() -> dict[str, Any]:
    return {"dense": reference(BASE), "moe": reference(MOE_BASE)}


def test_stage_split_and_placement() -> None:
    assert layers_per_stage(10, 4) == [3, 3, 2, 2]
    assert layers_per_stage(4, 2, [1, 3]) == [1, 3]
    with pytest.raises(PipelineConfigError, match="pp_split=\\[1, 2\\] sums to 3 but model.n_layers=4"):
        layers_per_stage(4, 2, [1, 2])
    with pytest.raises(PipelineConfigError, match="pp_split has 3 entries but there are 2 stages"):
        layers_per_stage(4, 2, [1, 2, 1])
    with pytest.raises(PipelineConfigError, match="n_layers=2 is fewer than the 4 pipeline stages"):
        layers_per_stage(2, 4)
    assert stage_ids("interleaved_1f1b", 1, 4, 2) == [1, 5]
    assert stage_ids("zbv", 1, 4, 2) == [1, 6]

    cfg = ModelConfig(preset="tiny", n_layers=4)
    p = ParallelConfig(pp=2, pp_schedule="1f1b", pp_split=[1, 3])
    (first,), ids, n = split_model(build_model(cfg), cfg, p, 0)
    (last,), _, _ = split_model(build_model(cfg), cfg, p, 1)
    assert ids == [0] and n == 2
    assert list(first.layers.keys()) == ["0"] and first.output is None and first.tok_embeddings is not None
    assert list(last.layers.keys()) == ["1", "2", "3"] and last.tok_embeddings is None and last.norm is not None
    names = {n for n, _ in first.named_parameters()} | {n for n, _ in last.named_parameters()}
    assert names == {n for n, _ in build_model(cfg).named_parameters()}  # nothing lost, names global

    with pytest.raises(PipelineConfigError, match="pp_schedule=1f1b runs one stage per rank"):
        split_model(build_model(cfg), cfg, ParallelConfig(pp=2, pp_stages_per_rank=2), 0)


def test_bubble_fraction() -> None:
    assert bubble_fraction("1f1b", 4, 8) == 3 / 8
    assert bubble_fraction("interleaved_1f1b", 4, 8, 2) == 3 / 16
    assert bubble_fraction("gpipe", 1, 8) == 0.0


@pytest.mark.parametrize("name", [lay["name"] for lay in LAYOUTS + MOE_LAYOUTS])
def test_pipeline_layout_matches_one_process(name: str, runs: dict[str, Any], refs: dict[str, Any]) -> None:
    check_parity(runs[name], refs["moe" if name.startswith("moe") else "dense"], name)


def test_microbatch_count_must_split_the_local_batch() -> None:
    from parallel.pp import build_schedule

    with pytest.raises(PipelineConfigError, match="pp_microbatches=3 equal micro-batches"):
        build_schedule([], [], 2, ParallelConfig(pp=2, pp_microbatches=3), None, torch.device("cpu"),
                       lambda a, b: a, 8)
