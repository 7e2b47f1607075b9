"""AdamW, the warmup + cosine schedule, and gradient clipping across the whole mesh."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial
from torch.optim.adam import adam

from parallel.config import TrainConfig


class AdamW(torch.optim.AdamW):
    """torch's AdamW, run on the local shards of DTensor parameters.

    Every op of the update is elementwise: where a parameter's gradient and states share its mesh and
    placements (none Partial), DTensor runs the same kernels on the same local tensors, so the result is
    bitwise the same. What DTensor adds is planning each foreach op's sharding, and those plans are
    cached per mesh: every re-formed group paid ~24 of them (0.3-1 s on CPU for a tiny model) in its
    first step, the zero-lr step DCP takes to build the state a restore loads into. A group that does
    not match that way is stepped on its DTensors, as torch does.
    """

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def,override]
        # torch >= 2.9's name; torch 2.11's may still be the CUDA-only one (a warning check only).
        getattr(self, "_accelerator_graph_capture_health_check", getattr(self, "_cuda_graph_capture_health_check",
                                                                         lambda: None))()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            exp_avgs: list[torch.Tensor] = []
            exp_avg_sqs: list[torch.Tensor] = []
            max_sqs: list[torch.Tensor] = []
            steps: list[torch.Tensor] = []
            has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps)
            lists = (params, grads, exp_avgs, exp_avg_sqs, max_sqs)
            beta1, beta2 = group["betas"]
            adam(*(_local_views(lists) or lists), steps, amsgrad=group["amsgrad"], has_complex=has_complex,
                 beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                 maximize=group["maximize"], foreach=group["foreach"], capturable=group["capturable"],
                 differentiable=group["differentiable"], fused=group["fused"],
                 grad_scale=getattr(self, "grad_scale", None), found_inf=getattr(self, "found_inf", None),
                 decoupled_weight_decay=group["decoupled_weight_decay"])  # fmt: skip
        return loss


def _pending(placements: Iterable[Any]) -> bool:
    """Whether a DTensor's placements hold pending sums (Partial): its local tensors are not its pieces, so
    it cannot be stepped or measured on them."""
    return any(isinstance(pl, Partial) for pl in placements)


def _local_views(lists: tuple[list[torch.Tensor], ...]) -> tuple[list[torch.Tensor], ...] | None:
    """The lists (parameters first, then gradients and states, an empty one for a state not kept) with each
    DTensor replaced by its local tensor; None where one of a parameter's tensors is on another mesh or
    placements, or Partial, or plain beside a DTensor parameter (DTensor would redistribute it)."""
    out: tuple[list[torch.Tensor], ...] = tuple([] for _ in lists)
    for i, p in enumerate(lists[0]):
        dt = isinstance(p, DTensor)
        if dt and _pending(p.placements):
            return None
        for k, ts in enumerate(lists):
            if not ts:
                continue
            t = ts[i]
            if not dt:
                if isinstance(t, DTensor):
                    return None
                out[k].append(t)
            elif (not isinstance(t, DTensor) or t.placements != p.placements
                  or (t.device_mesh is not p.device_mesh and t.device_mesh != p.device_mesh)):
                return None
            else:
                out[k].append(t._local_tensor)
    return out


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW (run on local shards: `AdamW`); weight decay on matrices only (not norms). Fused on CUDA,
    foreach elsewhere."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = []
    for params, wd in ((decay, cfg.weight_decay), (no_decay, 0.0)):
        # foreach/fused kernels refuse a list mixing DTensors and plain tensors (e.g. TP without
        # FSDP leaves replicated MoE layers plain): split such a group in two. Layouts without
        # the mix keep the usual two groups, so their optimizer states stay interchangeable.
        dtensors = [p for p in params if isinstance(p, DTensor)]
        plain = [p for p in params if not isinstance(p, DTensor)]
        groups += [{"params": part, "weight_decay": wd} for part in (dtensors, plain) if part]
    fused = device.type == "cuda"
    return AdamW(
        groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused, foreach=None if fused else True
    )


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of cfg.lr at (0-based) step: linear warmup, then cosine down to min_lr_ratio."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    decay_steps = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))


def set_scheduler_step(scheduler: torch.optim.lr_scheduler.LambdaLR, step: int) -> None:
    """Put the schedule at `step` (the next step to run) and set the optimizer's lr to match."""
    scheduler.last_epoch = step
    scheduler._step_count = step + 1
    lrs = [base * lam(step) for base, lam in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs


@torch.no_grad()
def grad_norm(parameters: Iterable[nn.Parameter], pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The 2-norm of all gradients of the model, over every shard on every mesh dimension.

    DTensor gradients (FSDP, TP, or both) are grouped by mesh and placements. Each group's squares are
    summed on the local shards and all-reduced over the mesh dims the group is sharded on (a Replicate
    dim holds copies: not summed again). Plain torch, as `AdamW` steps: DTensor's own foreach norm plans
    its sharding, and after a re-form (its caches reset) that planning took ~0.1 s of the group's first
    step on CPU, on the recovery's path. With pipeline parallelism each stage holds other parameters,
    so the squares are summed over pp.
    """
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in parameters:
        if p.grad is None:
            continue
        g = p.grad
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
        groups[key].append(g)
    sq = None
    for key, grads in groups.items():
        part = _sum_of_squares(grads, key)
        sq = part if sq is None else sq + part.to(sq.device)
    if sq is None:
        sq = torch.zeros(())
    if pp_group is not None:
        dist.all_reduce(sq, group=pp_group)
    return sq.sqrt()


def _sum_of_squares(grads: list[torch.Tensor], key: tuple[Any, Any] | None) -> torch.Tensor:
    """The squared norm of one group of gradients (plain, or DTensors of one mesh and placements)."""
    if key is None:
        return torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True).float() ** 2
    mesh, placements = key
    if _pending(placements):  # DTensor reduces the pending sums first
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        return (norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2
    local = [g._local_tensor for g in grads]
    part = torch.nn.utils.get_total_norm(local, norm_type=2.0, foreach=True).float() ** 2
    for dim, pl in enumerate(placements):
        if not pl.is_replicate():  # Shard, or FSDP x TP's _StridedShard (is_shard() says False): disjoint pieces
            dist.all_reduce(part, group=mesh.get_group(dim))
    return part


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[nn.Parameter], max_norm: float | None, pp_group: dist.ProcessGroup | None = None
) -> float:
    """Clip gradients to max_norm (None: only measure); returns the total norm before clipping.

    The scaling is torch's (clip_grads_with_norm_'s coefficient), applied to the local tensors: scaling
    every shard scales the whole gradient, Partial ones too, with no DTensor op to plan (see grad_norm)."""
    params = [p for p in parameters if p.grad is not None]
    total = grad_norm(params, pp_group)
    if max_norm is not None and params:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for p in params:
            g = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
            by_kind[(g.device, g.dtype)].append(g)
        for (device, _), grads in by_kind.items():
            torch._foreach_mul_(grads, coef.to(device))
    return float(total)
