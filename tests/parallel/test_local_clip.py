"""parallel.optim.clip_grad_norm_ measures and scales gradients on their local shards: the norm and the
clipped gradients are torch's (clip_grad_norm_ on the DTensors), without DTensor planning a foreach op,
which every re-formed mesh paid again in its first step (on the recovery's path)."""

from __future__ import annotations

from typing import Any

import torch

from tests.parallel._spawn import run_ranks
from tests.parallel.dtensor_plans import fsdp_model, planned_ops


def _grads(rank: int) -> Any:
    model = fsdp_model(0)
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(1 + rank))
    (model(x).square().sum() * 10).backward()  # a norm well above max_norm: the clip scales
    return model


def _compare(rank: int, world: int) -> dict[str, Any]:
    from parallel.optim import clip_grad_norm_

    def clipped(fn: Any) -> tuple[float, list[torch.Tensor], int]:
        model = _grads(rank)
        with planned_ops() as planned:
            norm = float(fn(list(model.parameters()), 1.0))
        return norm, [p.grad.to_local().clone() for p in model.parameters()], len(planned)

    ours, ours_grads, ours_planned = clipped(clip_grad_norm_)
    theirs, theirs_grads, theirs_planned = clipped(torch.nn.utils.clip_grad_norm_)
    close = all(torch.allclose(a, b, rtol=1e-6, atol=0) for a, b in zip(ours_grads, theirs_grads, strict=True))
    return {"ours": ours, "theirs": theirs, "close": close, "ours_planned": ours_planned,
            "theirs_planned": theirs_planned}


def _partial_norm(rank: int, world: int) -> tuple[float, float]:
    """A Partial gradient (pending sums) is measured after DTensor reduces it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

    from parallel.optim import grad_norm

    mesh = init_device_mesh("cpu", (world,))
    p = torch.nn.Parameter(distribute_tensor(torch.zeros(3), mesh, [Replicate()]))
    p.grad = DTensor.from_local(torch.tensor([1.0, 2.0, 2.0]) * (rank + 1), mesh, [Partial()])
    full = torch.tensor([1.0, 2.0, 2.0]) * sum(range(1, world + 1))
    return float(grad_norm([p])), float(full.norm())


def test_local_clip_is_torchs_and_plans_no_dtensor_op() -> None:
    outs = run_ranks(_compare, 2)
    for out in outs:
        assert abs(out["ours"] - out["theirs"]) <= 1e-6 * out["theirs"] and out["theirs"] > 1.0, out
        assert out["close"], "the clipped gradients differ from torch.nn.utils.clip_grad_norm_'s"
        assert out["theirs_planned"] > 0, out  # the check can fail: torch's clip plans its DTensor ops
        assert out["ours_planned"] == 0, out
    assert len({out["ours"] for out in outs}) == 1, outs  # every rank has the whole norm


def test_partial_gradient_is_reduced_before_its_norm() -> None:
    for got, want in run_ranks(_partial_norm, 2):
        assert abs(got - want) <= 1e-6 * want, (got, want)
