"""Compositions of pipeline, context and expert parallelism with FSDP and TP, through the Trainer.

Each layout trains 10 steps and must match one process (losses ≤1e-5 fp32, final weights).
One 4-rank launch holds cp=2, cp=4 and the 2-D mixes; one 8-rank launch (slow) mixes three
dimensions at once.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.parallel.layout_parity import check_parity, reference, run_many

STEPS = 10
TRAIN: dict[str, Any] = {"steps": STEPS, "seq_len": 32, "global_batch_size": 8, "warmup_steps": 2, "lr": 1e-3}
DENSE: dict[str, Any] = {"model": {"preset": "tiny", "n_layers": 4}, "training": TRAIN}
MOE: dict[str, Any] = {
    "model": {"preset": "mixtral-tiny", "moe": {"num_experts": 4, "top_k": 2, "aux_loss_coef": 0.1}},
    "training": TRAIN,
}

DENSE_4: list[dict[str, Any]] = [
    dict(name="cp2", world=2, parallelism={"cp": 2}),
    dict(name="cp4", world=4, parallelism={"cp": 4}),
    dict(name="fsdp2xcp2", world=4, parallelism={"cp": 2}),
    dict(name="tp2xcp2", world=4, parallelism={"tp": 2, "cp": 2}),
    dict(name="pp2xtp2", world=4, parallelism={"pp": 2, "tp": 2, "pp_microbatches": 4}),
    dict(name="pp2xtp2-zbv", world=4, parallelism={"pp": 2, "tp": 2, "pp_schedule": "zbv", "pp_stages_per_rank": 2,
                                                   "pp_microbatches": 4}),
    dict(name="pp2xcp2", world=4, parallelism={"pp": 2, "cp": 2, "pp_microbatches": 2}),
    dict(name="cp2-ac", world=2, parallelism={"cp": 2}, training={"activation_checkpointing": "full"}),
]
MOE_4: list[dict[str, Any]] = [
    dict(name="moe-cp2", world=2, parallelism={"cp": 2}),
    dict(name="moe-fsdp2xep2", world=4, parallelism={"dp_shard": 4, "ep": 2}),
    dict(name="moe-cp2xep2", world=4, parallelism={"cp": 2, "ep": 2}),
]
DENSE_8: list[dict[str, Any]] = [
    dict(name="pp2xfsdp2xtp2-zbv", world=8, parallelism={
        "pp": 2, "tp": 2, "pp_schedule": "zbv", "pp_stages_per_rank": 2, "pp_microbatches": 2}),
    dict(name="fsdp2xtp2xcp2", world=8, parallelism={"tp": 2, "cp": 2}),
]
MOE_8: list[dict[str, Any]] = [
    dict(name="moe-fsdp4xcp2xep4", world=8, parallelism={"cp": 2, "ep": 4}),
    dict(name="moe-pp2xfsdp4xep2", world=8, parallelism={"pp": 2, "ep": 2, "pp_microbatches": 2}),
]

_REFS: dict[str, Any] = {}


def _ref(name: str) -> Any:
    kind = "moe" if name.startswith("moe") else "dense"
    if kind not in _REFS:
        _REFS[kind] = reference(MOE if kind == "moe" else DENSE)
    return _REFS[kind]


@pytest.fixture(scope="module")
def runs4() -> dict[str, Any]:
    return run_many([(DENSE, DENSE_4), (MOE, MOE_4)], 4, timeout_s=600)


@pytest.fixture(scope="module")
def runs8() -> dict[str, Any]:
    return run_many([(DENSE, DENSE_8), (MOE, MOE_8)], 8, timeout_s=600)


@pytest.mark.parametrize("name", [lay["name"] for lay in DENSE_4 + MOE_4])
def test_two_dim_layouts_match_one_process(name: str, runs4: dict[str, Any]) -> None:
    check_parity(runs4[name], _ref(name), name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [lay["name"] for lay in DENSE_8 + MOE_8])
def test_three_dim_layouts_match_one_process(name: str, runs8: dict[str, Any]) -> None:
    check_parity(runs8[name], _ref(name), name)
