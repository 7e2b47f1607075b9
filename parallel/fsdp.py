"""FSDP2 (`fully_shard`): ZeRO stages, HSDP, mixed precision, CPU offload.

What each ZeRO stage means here. FSDP2 always keeps parameters sharded *at rest* (between
steps) and always shards optimizer states (they follow the sharded parameters); the stages
differ in what is kept during a step:
- stage 3: `reshard_after_forward=True` -- parameters are all-gathered for each block's forward,
  freed, and gathered again for its backward; gradients are reduce-scattered (sharded).
- stage 2: `reshard_after_forward=False` -- parameters gathered in forward stay unsharded until
  that block's backward (no second all-gather); gradients are reduce-scattered every micro-batch
  (sharded), optimizer states sharded.
- stage 1: as stage 2, and in addition gradients are *not* reduced for the micro-batches before
  the last one of a step (`set_requires_gradient_sync(False)`): unsharded gradients accumulate
  locally and one reduce-scatter per step shards them. So during a step both parameters and
  gradients are whole on each rank and only optimizer states (and parameters at rest) are
  sharded -- ZeRO-1's memory profile, expressed with FSDP2's hooks. The trainer applies the
  sync toggle (see `needs_sync_toggle`).

Units: FSDP gathers and reduces one unit's parameters with one collective each. One unit per block
bounds the unsharded memory to a block's, but on a small model the collectives' fixed cost (a gloo
call's latency, FSDP's hooks) outweighs their bytes: on the debug preset over 4 CPU ranks one unit per
block made the step 1.5x a plain loop's, one unit for the model matched it. So consecutive blocks are
grouped until a unit holds `parallelism.fsdp_unit_mib` (layout_rules.fsdp_units, the planner's rule
too); blocks that would all make one unit join the root's, the model's only unit.

HSDP: with dp_replicate > 1 the mesh is 2D (replicate, shard): parameters are sharded within a
group of dp_shard*cp ranks and replicated across groups; gradients are reduce-scattered within
and all-reduced across.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from parallel.layout_rules import fsdp_units


def needs_sync_toggle(zero_stage: int) -> bool:
    """Stage 1 reduces gradients only on a step's last micro-batch."""
    return zero_stage == 1


def _local_bytes(module: nn.Module) -> int:
    """Parameter bytes this rank holds of `module` before FSDP shards it (after TP's split)."""
    total = 0
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    zero_stage: int = 3,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    cpu_offload: bool = False,
    device_type: str = "cpu",
    reshard_after_forward: bool | None = None,
    unit_mib: float = 0.0,
) -> nn.Module:
    """Shard the transformer blocks in units of at least `unit_mib` MiB (`fsdp_units`), then the root
    (embeddings, final norm, output, and blocks in no unit).

    `mesh` is 1D (FSDP over dp_shard x cp) or 2D (HSDP: dp_replicate, dp_shard x cp).
    `reshard_after_forward` overrides the stage's choice (pipeline stages pass False: the
    zero-bubble schedules give wrong gradients with True on torch 2.13).
    """
    if zero_stage not in (1, 2, 3):
        raise ValueError(f"parallelism.zero_stage={zero_stage} must be 1, 2 or 3")
    reshard = (zero_stage == 3) if reshard_after_forward is None else reshard_after_forward
    kwargs: dict = {"mesh": mesh}
    if param_dtype != torch.float32 or reduce_dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if cpu_offload:
        # pin_memory needs a GPU; without one pinning crashes.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device_type == "cuda")
    layers = getattr(model, "layers", None)
    units: list[range] = []
    if layers is not None:
        blocks = list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)
        units = fsdp_units([_local_bytes(b) for b in blocks], unit_mib * 2**20)
        for i, unit in enumerate(units):
            members = [blocks[j] for j in unit]
            # The last unit's parameters are needed again at once by backward: keep them.
            fully_shard(members if len(members) > 1 else members[0],
                        reshard_after_forward=reshard and i < len(units) - 1, **kwargs)
    # A root that holds every block is needed again at once by backward, as the last unit is.
    fully_shard(model, reshard_after_forward=reshard and bool(units), **kwargs)
    return model
