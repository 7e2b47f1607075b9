"""parallel.optim.AdamW steps on the local shards of DTensor parameters: bitwise what torch's AdamW
does on the DTensors, without DTensor planning the foreach ops (what every re-formed mesh paid again)."""

from __future__ import annotations

from typing import Any

import torch

from tests.parallel._spawn import run_ranks
from tests.parallel.dtensor_plans import fsdp_model, planned_ops


def _train(opt_cls: type, rank: int, steps: int) -> tuple[list[torch.Tensor], int]:
    from torch.distributed.tensor import DTensor

    from parallel import dist as pdist

    pdist.reset_dtensor_caches()  # each optimizer starts as a freshly formed mesh does
    model = fsdp_model(0)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = opt_cls([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                  lr=1e-2, foreach=True)
    planned: list[str] = []
    g = torch.Generator().manual_seed(1 + rank)
    for _ in range(steps):
        x = torch.randn(4, 7, generator=g)
        model(x).square().sum().backward()
        with planned_ops() as ops:
            opt.step()
        planned += ops
        opt.zero_grad()
    out = [p.to_local().clone() if isinstance(p, DTensor) else p.clone() for p in model.parameters()]
    for state in opt.state.values():
        out += [t.to_local().clone() if isinstance(t, DTensor) else t.clone() for t in state.values()]
    return out, sum("foreach" in op for op in planned)


def _compare(rank: int, world: int) -> dict[str, Any]:
    from parallel.optim import AdamW

    ours, ours_planned = _train(AdamW, rank, 3)
    theirs, theirs_planned = _train(torch.optim.AdamW, rank, 3)
    same = len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    return {"same": same, "ours_planned": ours_planned, "theirs_planned": theirs_planned}


def _partial_grad(rank: int, world: int) -> bool:
    """A Partial gradient (DTensor would all-reduce it first) is not stepped locally."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

    from parallel.optim import _local_views

    mesh = init_device_mesh("cpu", (world,))
    p = distribute_tensor(torch.ones(4), mesh, [Replicate()])
    g = DTensor.from_local(torch.ones(4), mesh, [Partial()])
    ok = _local_views(([p], [p.detach()], [], [], [])) is not None
    return ok and _local_views(([p], [g], [], [], [])) is None


def test_local_step_is_bitwise_torchs_and_plans_no_foreach_op() -> None:
    for out in run_ranks(_compare, 2):
        assert out["same"], "parameters or optimizer states differ from torch.optim.AdamW's"
        assert out["theirs_planned"] > 0, out  # the check can fail: torch's step plans its foreach ops
        assert out["ours_planned"] == 0, out


def test_partial_gradient_takes_the_dtensor_step() -> None:
    assert all(run_ranks(_partial_grad, 2))
