"""Tensor parallelism (Megatron-style) with sequence parallelism and loss parallelism.

Per block: wq/wk/wv and w1/w3 are split by columns (output features: heads and FFN width),
wo and w2 by rows, so each block needs one all-reduce (or with sequence parallelism one
all-gather before and one reduce-scatter after) per sub-layer. With sequence parallelism the
norms run on sequence shards (Shard(1)) and activations between sub-layers stay sharded on the
sequence. The embedding is split by rows (vocabulary). The output projection is split by
columns; with loss parallelism its logits stay a vocab-sharded DTensor (Shard(-1)) and the loss
is computed under `loss_parallel()` without gathering them.

The model reads head counts from tensor shapes (`view(..., -1, head_dim)`), so local heads
need no change; GQA's repeat factor n_heads/n_kv_heads is the same locally. MoE feed-forwards
are not split by tp: they run replicated on the gathered sequence (`parallel.ep.moe_tp_plan`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def apply_tp(
    model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = True, loss_parallel: bool = True
) -> nn.Module:
    """Rewrite `model` in place over the 1D `tp_mesh` (call before activation checkpointing and FSDP)."""
    sp = sequence_parallel
    act = Shard(1) if sp else Replicate()  # layout of activations between sub-layers
    top: dict[str, object] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=act)
    if getattr(model, "norm", None) is not None and sp:
        top["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        top["output"] = ColwiseParallel(
            input_layouts=act,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    tied = (
        getattr(model, "tok_embeddings", None) is not None and getattr(model, "output", None) is not None
        and model.output.weight is model.tok_embeddings.weight
    )
    if top:
        parallelize_module(model, tp_mesh, top)
    if tied:
        # Row-wise embedding and column-wise output both shard the (vocab, dim) weight on dim 0,
        # so the two modules can share one DTensor again (parallelize_module made two).
        model.output.weight = model.tok_embeddings.weight

    for block in model.layers.values():
        plan: dict[str, object] = {
            "attention": PrepareModuleInput(
                input_layouts=(act, None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=act),
        }
        if sp:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        if getattr(block.attention, "q_norm", None) is not None:
            # Qwen3's per-head q/k norms see this rank's heads (dim 2 of (batch, seq, heads, head_dim)):
            # their weights become replicated DTensors, so the gradient sums over every rank's heads.
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        if getattr(block, "moe_enabled", False):
            # A MoE layer runs replicated over tp on the gathered sequence (its experts are split
            # by expert parallelism instead); parallel.ep owns that plan.
            from parallel.ep import moe_tp_plan

            plan.update(moe_tp_plan(act))
            parallelize_module(block, tp_mesh, plan)
            continue
        plan.update({
            "feed_forward": PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=act),
        })
        parallelize_module(block, tp_mesh, plan)
    return model
