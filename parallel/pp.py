"""Pipeline parallelism: cut the model into stages and run them with a torch.distributed.pipelining schedule.

A stage is a copy of the (meta) model that keeps only its own layers: the embedding lives on
the first stage, the final norm and output on the last; layer names stay global
(`layers.5....`), so checkpoints and weight init do not depend on the cut. With v stages per
rank there are pp·v stages: "loop" placement (rank r holds stages r, r+pp, ...) for the
interleaved schedules, "v" placement (rank r holds r and 2·pp−1−r) for ZBV.

Schedules: gpipe, 1f1b (one stage per rank), interleaved_1f1b, zero_bubble
(ScheduleInterleavedZeroBubble), zbv (ScheduleZBVZeroBubble). Stages under FSDP must use
`reshard_after_forward=False`: the zero-bubble schedules give silently wrong gradients otherwise
(measured on torch 2.13; see NOTES.md). Whether a pipeline layout can run is the layout authority's
to say (parallel/layout_rules.py); the bubble of each schedule is the planner's (parallel/planner/timing.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from parallel.config import ModelConfig, ParallelConfig
from parallel.layout_rules import (
    LayoutProblem,
    ParallelDimsError,
    microbatch_problems,
    schedule_problems,
    stage_split_problems,
)

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")


class PipelineConfigError(ParallelDimsError):
    """A pipeline layout that cannot run; its problems name the field and the fix."""


def _raise_if(problems: list[LayoutProblem]) -> None:
    if problems:
        raise PipelineConfigError(problems)


def num_virtual_stages(p: ParallelConfig) -> int:
    """Stages per rank: 1 for gpipe/1f1b, pp_stages_per_rank (>= 2) for the others."""
    _raise_if(schedule_problems(p.pp_schedule, max(p.pp, 2), p.pp_stages_per_rank))
    return p.pp_stages_per_rank


def layers_per_stage(n_layers: int, n_stages: int, split: list[int] | None = None) -> list[int]:
    """The number of layers of each stage: `split` if given, else as even as possible
    (the earlier stages take the remainder; the last stage also carries the output)."""
    _raise_if(stage_split_problems(n_layers, n_stages, split))
    if split is not None:
        return list(split)
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if s < extra else 0) for s in range(n_stages)]


def stage_ids(schedule: str, pp_rank: int, pp: int, v: int) -> list[int]:
    """The stage indices this pp rank holds, in order."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(v)]


def split_stage(model: nn.Module, stage: int, counts: list[int]) -> nn.Module:
    """A copy of `model` (a meta-device Transformer) holding only stage `stage`'s parts."""
    first = sum(counts[:stage])
    keep = {str(i) for i in range(first, first + counts[stage])}
    part = copy.deepcopy(model)
    for name in list(part.layers.keys()):
        if name not in keep:
            del part.layers[name]
    if stage != 0:
        part.tok_embeddings = None
    if stage != len(counts) - 1:
        part.norm = None
        part.output = None
    return part


@dataclass
class Pipeline:
    """What a pp rank runs: its stage modules (in stage order) and the schedule driving them."""

    schedule: Any
    parts: list[nn.Module]
    stage_ids: list[int]
    n_stages: int
    microbatches: int

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one local batch; returns the sum of the micro-batch losses
        (as the loss function returned them) on the rank holding the last stage, else 0.
        `kwargs` (batch-first tensors) reach every stage's forward, cut per micro-batch."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        target = targets if self.has_last else None
        self.schedule.step(*args, target=target, losses=losses if self.has_last else None, return_outputs=False,
                           **kwargs)
        return self._total(losses, inputs)

    def eval(self, inputs: torch.Tensor, targets: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        """As `step`, forward only (the schedule's eval; call under torch.no_grad())."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        target = targets if self.has_last else None
        self.schedule.eval(*args, target=target, losses=losses if self.has_last else None, return_outputs=False,
                           **kwargs)
        return self._total(losses, inputs)

    @staticmethod
    def _total(losses: list[torch.Tensor], inputs: torch.Tensor) -> torch.Tensor:
        if not losses:
            return torch.zeros((), dtype=torch.float32, device=inputs.device)
        return torch.stack([loss.detach().float() for loss in losses]).sum()


def split_model(
    model: nn.Module, model_cfg: ModelConfig, p: ParallelConfig, pp_rank: int
) -> tuple[list[nn.Module], list[int], int]:
    """Cut the meta `model` for `pp_rank`: (stage modules, their stage ids, total stages)."""
    v = num_virtual_stages(p)
    n_stages = p.pp * v
    counts = layers_per_stage(model_cfg.n_layers, n_stages, p.pp_split)
    ids = stage_ids(p.pp_schedule, pp_rank, p.pp, v)
    return [split_stage(model, s, counts) for s in ids], ids, n_stages


def build_schedule(
    parts: list[nn.Module],
    ids: list[int],
    n_stages: int,
    p: ParallelConfig,
    pp_group: Any,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    local_batch_size: int,
) -> Pipeline:
    """Wrap the (already parallelised and initialised) stage modules and build the schedule.

    `loss_fn(output, target)` is what each micro-batch backpropagates; gradients are not
    rescaled by the schedule (it should already carry the global normalisation).
    """
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    _raise_if(microbatch_problems(p.pp, p.pp_microbatches, local_batch_size))
    m = p.pp_microbatches or p.pp
    stages = [PipelineStage(part, s, n_stages, device, group=pp_group) for part, s in zip(parts, ids, strict=True)]
    common: dict[str, Any] = {"n_microbatches": m, "loss_fn": loss_fn, "scale_grads": False}
    if p.pp_schedule == "gpipe":
        schedule = ScheduleGPipe(stages[0], **common)
    elif p.pp_schedule == "1f1b":
        schedule = Schedule1F1B(stages[0], **common)
    elif p.pp_schedule == "interleaved_1f1b":
        schedule = ScheduleInterleaved1F1B(stages, **common)
    elif p.pp_schedule == "zero_bubble":
        schedule = ScheduleInterleavedZeroBubble(stages, **common)
    elif p.pp_schedule == "zbv":
        schedule = ScheduleZBVZeroBubble(stages, **common)
    else:  # the config's Literal keeps this unreachable; say so if it is reached anyway
        raise PipelineConfigError([LayoutProblem("parallelism.pp_schedule",
                                                 f"parallelism.pp_schedule={p.pp_schedule!r} is unknown",
                                                 f"use one of {SCHEDULES}")])
    return Pipeline(schedule=schedule, parts=parts, stage_ids=ids, n_stages=n_stages, microbatches=m)


def apply_pp(
    model: nn.Module,
    model_cfg: ModelConfig,
    p: ParallelConfig,
    pp_mesh: Any,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    local_batch_size: int,
    parallelize: Callable[[nn.Module], nn.Module] | None = None,
) -> Pipeline:
    """Split the meta `model` into this pp rank's stages, parallelise each part with
    `parallelize` (TP/AC/FSDP and weight init, as for a whole model), and build the schedule.

    pp_mesh: the 1-D "pp" DeviceMesh (or a ProcessGroup).
    """
    group = pp_mesh.get_group() if hasattr(pp_mesh, "get_group") else pp_mesh
    import torch.distributed as dist

    pp_rank = dist.get_rank(group)
    parts, ids, n_stages = split_model(model, model_cfg, p, pp_rank)
    if parallelize is not None:
        parts = [parallelize(part) for part in parts]
    return build_schedule(parts, ids, n_stages, p, group, device, loss_fn, local_batch_size)
