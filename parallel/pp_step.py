"""The Trainer's pipeline-parallel path: building the stages, one train step, the full state.

Kept apart from `parallel.trainer` so the dense path stays short. The stages of one pp rank are
presented to the rest of the Trainer (optimizer, DCP state dicts, grad clipping) as one module,
`StageView`, whose parameter names are the global ones (`layers.5.attention.wq.weight`): a
checkpoint written with pp=2 loads into pp=1 and back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallel.data.types import Batch
from parallel.pp import Pipeline, apply_pp


class StageView(nn.Module):
    """The union of this rank's stage modules with the whole model's names (shares their parameters)."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict()
        for part in parts:
            for name, block in part.layers.items():
                self.layers[name] = block
            for attr in ("tok_embeddings", "norm", "output"):
                if getattr(part, attr, None) is not None:
                    setattr(self, attr, getattr(part, attr))
        # Sorted by global layer index, as the whole model lists them.
        self.layers = nn.ModuleDict(sorted(self.layers.items(), key=lambda kv: int(kv[0])))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a pipeline rank's StageView is not callable; run Pipeline.step")


def _positions_hook(sp_degree: int, cp_rank: int, cp: int) -> Callable[..., Any]:
    """A forward pre-hook giving a stage the global positions of the tokens it holds.

    A stage sees only its input tensor, so it cannot tell the sequence it belongs to: with
    sequence parallelism hidden states between stages are sequence shards (tp of them), and
    with context parallelism every rank holds a zigzag shard of each sequence. (A hook, not a
    wrapper module: the schedules treat FSDP-wrapped stages specially, so the stage module must
    stay the FSDP module itself.)
    """
    from parallel.cp import cp_positions

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        x = args[0]
        n = x.shape[1] * (sp_degree if x.dim() == 3 else 1)  # hidden states: a tp shard
        positions = cp_positions(n * cp, cp_rank, cp) if cp > 1 else torch.arange(n)
        return args, {**kwargs, "positions": positions.to(x.device)}

    return hook


def build_pipeline(
    model: nn.Module,
    trainer: Any,
    parallelize: Callable[[nn.Module], nn.Module],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[Pipeline, StageView]:
    """Cut the meta `model` into this rank's stages, parallelise each, build the schedule."""
    cfg, dims, mesh = trainer.cfg, trainer.dims, trainer.mesh
    p = cfg.parallelism
    if dims.cp_enabled and p.cp_impl != "ring":
        raise ValueError(f"parallelism.cp_impl={p.cp_impl} is not supported with pp > 1; use cp_impl: ring")
    local_bs = dims.local_batch_size(cfg.training.global_batch_size)
    sp = dims.tp if dims.tp_enabled and p.sequence_parallel else 1
    cp_rank = dims.get_mesh(mesh, "cp").get_local_rank() if dims.cp_enabled else 0

    pipe = apply_pp(model, cfg.model, p, dims.get_mesh(mesh, "pp"), trainer.device, loss_fn, local_bs, parallelize)
    if sp > 1 or dims.cp > 1:
        for part in pipe.parts:
            part.register_forward_pre_hook(_positions_hook(sp, cp_rank, dims.cp), with_kwargs=True)
    return pipe, StageView(pipe.parts)


def pipeline_step(pipe: Pipeline, micro: list[Batch], device: torch.device,
                  pp_group: dist.ProcessGroup, cp_rank: int = 0, cp: int = 1, *, train: bool = True) -> torch.Tensor:
    """One step over this dp rank's rows (all its micro-batches joined: the schedule re-cuts
    them into pp_microbatches), each sequence cut to this rank's zigzag shard when cp > 1.
    Returns the sum of what the loss function returned, on every pp rank; train=False: forward only."""
    inputs = torch.cat([b.inputs for b in micro])
    targets = torch.cat([b.targets for b in micro])
    if cp > 1:
        from parallel.cp import shard_sequence

        inputs, targets = shard_sequence(inputs, cp_rank, cp), shard_sequence(targets, cp_rank, cp)
    inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
    # Document ids reach every stage as a keyword input (the schedule cuts them per micro-batch);
    # they stay whole-sequence under cp, as ring attention wants them.
    kwargs = {} if micro[0].doc_ids is None else {"doc_ids": torch.cat([b.doc_ids for b in micro]).to(device)}
    total = pipe.step(inputs, targets, **kwargs) if train else pipe.eval(inputs, targets, **kwargs)
    dist.all_reduce(total, group=pp_group)  # only the last stage's rank holds the losses
    return total


def gather_full_state(local_full: dict[str, torch.Tensor], pp_group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """Merge every pp rank's full (unsharded, CPU) stage tensors; the result is valid on pp rank 0."""
    world = dist.get_world_size(pp_group)
    gathered: list[Any] = [None] * world if dist.get_rank(pp_group) == 0 else []
    dist.gather_object(local_full, gathered if gathered else None, dst=dist.get_global_rank(pp_group, 0),
                       group=pp_group)
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        merged.update(part)
    return merged
