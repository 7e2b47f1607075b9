"""Expert parallelism: each rank of the "ep" mesh holds num_experts/ep whole experts.

The stacked expert weights `(num_experts, ...)` become DTensors sharded on dim 0 over the ep
mesh; the MoE layer then sends every routed token to the rank that owns its expert and back
with a differentiable all-to-all of uneven sizes (dropless; `parallel.moe.MoE._experts_ep`).

The ep ranks are part of dp_shard × cp (`ParallelDims`: ep = dp_shard_in_ep × cp), so each of
them brings its own tokens. With FSDP the experts are sharded further over the remaining data
ranks (dp_replicate × dp_shard_mod_ep), in their own FSDP group, while dense weights are
sharded over all of dp_shard × cp. Gradient arithmetic: the trainer scales the loss by the
FSDP degree F (so FSDP's average over F ranks becomes a sum); an expert's gradient already sums
the tokens of its ep group, and its FSDP group has only F/ep ranks, so its reduction divides
by F instead of by its own size.

With tensor parallelism the dense parts are split as usual and each MoE layer runs replicated
over the tp ranks: `parallel.tp.apply_tp` applies `moe_tp_plan` (tokens gathered on entry,
re-sharded on exit).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from parallel.moe import MoE, moe_modules


def apply_ep(model: nn.Module | list[nn.Module], ep_mesh: Any) -> None:
    """Shard every MoE layer's experts over the 1-D `ep_mesh` (meta or materialised model)."""
    from torch.distributed.tensor import DTensor, Shard

    ep = ep_mesh.size()
    rank = ep_mesh.get_local_rank()
    for moe in moe_modules(model):
        if moe.num_experts % ep:
            raise ValueError(
                f"parallelism.ep={ep} does not divide moe.num_experts={moe.num_experts}; pick a divisor"
            )
        n_local = moe.num_experts // ep
        experts = moe.experts
        for name in ("w1", "w2", "w3"):
            full = getattr(experts, name)
            if isinstance(full, DTensor):
                raise ValueError("apply_ep was already applied to this model (experts are DTensors)")
            local = full.detach()[rank * n_local : (rank + 1) * n_local]
            dt = DTensor.from_local(local.clone(), ep_mesh, [Shard(0)], run_check=False)
            setattr(experts, name, nn.Parameter(dt, requires_grad=full.requires_grad))
        moe.ep_group = ep_mesh.get_group()


def apply_expert_fsdp(
    model: nn.Module | list[nn.Module],
    expert_fsdp_mesh: Any,
    fsdp_size: int,
    *,
    reshard_after_forward: bool = True,
    mp_policy: Any = None,
) -> None:
    """Put each MoE layer's experts in their own FSDP group over `expert_fsdp_mesh` (the data
    ranks outside ep: dp_replicate × dp_shard_mod_ep); call before `apply_fsdp` on the blocks.

    `fsdp_size` is the dense FSDP degree the loss is scaled by (see the module docstring).
    """
    from torch.distributed.fsdp import fully_shard

    kwargs: dict[str, Any] = {"mesh": expert_fsdp_mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for moe in moe_modules(model):
        fully_shard(moe.experts, **kwargs)
        moe.experts.set_gradient_divide_factor(float(fsdp_size))
        shard_size = expert_fsdp_mesh.size(expert_fsdp_mesh.ndim - 1)
        if getattr(expert_fsdp_mesh, "device_type", "cpu") != "cuda" and shard_size > 1:
            # A custom factor uses NCCL's PreMulSum; gloo has none: sum, then divide. (Not with a
            # 1-rank shard group: torch 2.13 then skips the reduce-scatter, divides, and would
            # divide a second time after it.)
            moe.experts.set_force_sum_reduction_for_comms(True)


def expert_fsdp_mesh(dims: Any, mesh: Any) -> Any:
    """The mesh experts are FSDP-sharded over: (dp_replicate, dp_shard_mod_ep) or dp_shard_mod_ep."""
    if dims.dp_replicate > 1:
        return mesh["dp_replicate", "dp_shard_mod_ep"]
    return mesh["dp_shard_mod_ep"]


def moe_tp_plan(act: Any) -> dict[str, Any]:
    """Tensor-parallel plan entries for a MoE block's `feed_forward`: run it replicated over tp.

    `act` is the activation layout between sub-layers (Shard(1) with sequence parallelism,
    else Replicate()); the MoE sees the whole (gathered) sequence and its output goes back to `act`.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    return {
        "feed_forward": PrepareModuleInputOutput(
            input_layouts=(act,),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(act,),
            use_local_output=True,
        )
    }


def expert_load(model: nn.Module | list[nn.Module]) -> torch.Tensor | None:
    """(layers, experts) tokens routed to each expert by this rank in the last forward."""
    ms = [m for m in moe_modules(model) if m.last_tokens_per_expert is not None]
    return torch.stack([m.last_tokens_per_expert for m in ms]) if ms else None


__all__ = ["MoE", "apply_ep", "apply_expert_fsdp", "expert_fsdp_mesh", "moe_tp_plan", "expert_load"]
