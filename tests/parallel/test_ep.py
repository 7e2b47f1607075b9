"""Expert parallelism: the token dispatch against one process, and EP layouts through the Trainer.

One 4-rank launch: first the MoE layer alone at ep=2 (two groups) and ep=4, each rank with its
own tokens, one expert never chosen (zero splits), forward and backward against the unsharded
layer on all ranks' tokens; then ep=2, ep=4, fsdp2×ep2, hsdp and ep with activation
checkpointing through the Trainer for 10 steps against one process.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

from parallel.config import ModelConfig
from parallel.dims import ParallelDims, ParallelDimsError
from parallel.ep import apply_ep
from parallel.moe import MoE
from tests.parallel.layout_parity import check_parity, reference

STEPS = 10
BASE: dict[str, Any] = {
    "model": {"preset": "mixtral-tiny", "moe": {"num_experts": 4, "top_k": 2, "aux_loss_coef": 0.1}},
    "training": {"steps": STEPS, "seq_len": 32, "global_batch_size": 8, "warmup_steps": 2, "lr": 1e-3},
}
LAYOUTS: list[dict[str, Any]] = [
    dict(name="ep2", world=2, parallelism={"ep": 2}),
    dict(name="ep2-ac", world=2, parallelism={"ep": 2}, training={"activation_checkpointing": "full"}),
    dict(name="ep4", world=4, parallelism={"ep": 4}),
    dict(name="fsdp2xep2", world=4, parallelism={"ep": 2}),  # experts FSDP-sharded over the other 2
    dict(name="hsdp2x2-ep2", world=4, parallelism={"dp_replicate": 2, "ep": 2}),
    # 8 sequences over 3 ranks: padding rows must add no load-balancing gradient.
    dict(name="moe-fsdp3-padding", world=3, parallelism={}),
]


def _layer_check(ep_group: dist.ProcessGroup, ep_mesh: Any) -> float:
    """Max error of this rank's outputs and gradients, EP against the whole layer, relative to
    each tensor's largest entry (weights of std 0.3 make gradients of order 100)."""

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()

    cfg = ModelConfig(preset="mixtral-tiny", moe={"num_experts": 8, "top_k": 2, "aux_loss_coef": 0.5})
    world, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    torch.manual_seed(0)
    full = MoE(cfg)
    for p in full.parameters():
        torch.nn.init.normal_(p, std=0.3)
    with torch.no_grad():  # feature 0 is constant 1 and only expert 3 reads it: it is never chosen
        full.gate.weight[:, 0] = 0.0
        full.gate.weight[3] = 0.0
        full.gate.weight[3, 0] = -100.0
    full.aux_scale = 0.25
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 5 + r, cfg.dim, generator=gen) for r in range(world)]  # uneven token counts
    for x in xs:
        x[..., 0] = 1.0
    gs = [torch.randn_like(x) for x in xs]

    # Reference: the whole layer on every rank's tokens.
    ref_out = [full(x) for x in xs]
    loss = sum((o * g).sum() for o, g in zip(ref_out, gs, strict=True))
    params = dict(full.named_parameters())
    ref_grads = dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))

    ep = copy.deepcopy(full)
    apply_ep(ep, ep_mesh)
    x = xs[rank].clone()
    out = ep(x)
    (out * gs[rank]).sum().backward()
    err = rel(out, ref_out[rank])
    n_local = 8 // world
    for name in ("w1", "w2", "w3"):
        local = getattr(ep.experts, name).grad.to_local()
        want = ref_grads[f"experts.{name}"][rank * n_local : (rank + 1) * n_local]
        err = max(err, rel(local, want))
    gate = ep.gate.weight.grad.clone()
    dist.all_reduce(gate, group=ep_group)  # each rank routed its own tokens
    err = max(err, rel(gate, ref_grads["gate.weight"]))
    counts = ep.last_tokens_per_expert
    assert counts[3].item() == 0 and counts.sum().item() == x.shape[0] * x.shape[1] * 2
    return err


def ep_worker(ctx: Any, payload: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from tests.parallel.layout_parity import parity_many

    def layer() -> dict[str, float]:
        errs = {}
        mesh4 = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        errs["ep4"] = _layer_check(mesh4.get_group(), mesh4)
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("other", "ep"))
        errs["ep2"] = _layer_check(mesh2["ep"].get_group(), mesh2["ep"])
        return errs

    out = {"layer": ctx.in_group(4, "ep-layer", layer)}
    out.update(parity_many(ctx, payload))
    return out


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    from tests.parallel.harness import launch

    payload = {"runs": [{"base": BASE, "layouts": LAYOUTS}]}
    return launch("tests.parallel.test_ep:ep_worker", 4, payload, timeout_s=600)[0]


def test_dispatch_matches_whole_layer(runs: dict[str, Any]) -> None:
    for name, err in runs["layer"].items():
        assert err <= 1e-6, f"{name}: max relative error {err:.2e}"
    assert set(runs["layer"]) == {"ep2", "ep4"}


@pytest.mark.parametrize("name", [lay["name"] for lay in LAYOUTS])
def test_ep_layout_matches_one_process(name: str, runs: dict[str, Any]) -> None:
    check_parity(runs[name], _ref(), name)


_REF: list[Any] = []


def _ref() -> Any:
    if not _REF:
        _REF.append(reference(BASE))
    return _REF[0]


def test_ep_sizes_are_checked() -> None:
    with pytest.raises(ParallelDimsError, match="ep=3 does not divide dp_shard\\*cp=4"):
        ParallelDims(dp_replicate=1, dp_shard=4, cp=1, tp=1, pp=1, ep=3, world_size=4)
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=2, world_size=2)
    from parallel.config import TrainConfig

    with pytest.raises(ParallelDimsError, match="ep=2 needs a mixture-of-experts model"):
        dims.validate(ModelConfig(preset="tiny"), TrainConfig())
    with pytest.raises(ParallelDimsError, match="ep=2 does not divide moe.num_experts=3"):
        dims.validate(ModelConfig(preset="mixtral-tiny", moe={"num_experts": 3}), TrainConfig())
