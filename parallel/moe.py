"""Mixtral-style mixture of experts: a top-k router, SwiGLU experts, a load-balancing loss.

Layout-friendly by construction:
- the experts' weights are stacked 3-D tensors `(num_experts, ...)`, so expert parallelism
  shards dim 0 and each rank keeps whole experts (`parallel.ep.apply_ep`);
- routing is dropless: every token goes to its top-k experts, however uneven the load;
- with `ep_group` set, tokens travel to the rank that owns their expert and back through a
  differentiable all-to-all with uneven splits (the split sizes need one host sync).

The load-balancing loss (Switch / Mixtral: E · Σ_i f_i · P_i, 1.0 when balanced) is computed
per sequence and averaged over the sequences of the global batch, so its value and gradient
do not depend on how the batch is split over data-parallel ranks, micro-batches, pipeline
stages or context-parallel shards. It enters the gradient directly: the MoE output carries it
through a pass-through autograd function (as Megatron does), so no train step — pipelined or
not — has to collect it. `aux_scale` is the weight of one sequence's aux loss in the total
loss; the train step sets it to coef / global_sequences, times the FSDP degree as for the token
loss (default coef / local batch size), and marks padding rows with `set_row_mask`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel.config import ModelConfig
from parallel.param_names import canonical_name


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor parameter (EP/TP), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class _AddAuxGrad(torch.autograd.Function):
    """Returns `out` unchanged; in backward also sends `weight` (per sequence) as the gradient of `aux`."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (weight,) = ctx.saved_tensors
        return grad, weight, None


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU MLPs as stacked weights: w1/w3 (E, hidden, dim), w2 (E, dim, hidden).

    Each slice is laid out like an `nn.Linear` weight, so Mixtral's `experts.{i}.w1.weight`
    maps to `w1[i]` unchanged.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x: (N, dim) rows grouped by local expert, `counts[e]` rows for local expert e."""
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        if len(counts) != w1.shape[0]:
            raise ValueError(f"got token counts for {len(counts)} experts, this rank holds {w1.shape[0]}")
        outs = []
        for e, chunk in enumerate(torch.split(x, counts, dim=0)):
            outs.append((F.silu(chunk @ w1[e].t()) * (chunk @ w3[e].t())) @ w2[e].t())
        if not outs:
            return x.new_zeros(0, w2.shape[1])
        return torch.cat(outs, dim=0)


class MoE(nn.Module):
    """Top-k routed SwiGLU experts replacing a block's dense feed-forward."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.moe is None:
            raise ValueError("MoE needs model.moe to be set")
        self.num_experts = cfg.moe.num_experts
        self.top_k = cfg.moe.top_k
        self.aux_loss_coef = cfg.moe.aux_loss_coef
        hidden = cfg.moe.hidden_dim or cfg.ffn_dim
        self.gate = nn.Linear(cfg.dim, self.num_experts, bias=False)
        self.experts = GroupedExperts(cfg.dim, hidden, self.num_experts)
        # Set by the layouts, never saved: the expert-parallel and context-parallel groups.
        self.ep_group: dist.ProcessGroup | None = None
        self.cp_group: dist.ProcessGroup | None = None
        # The weight of one sequence's aux loss in the total loss; None: coef / local batch size.
        self.aux_scale: float | None = None
        # Optional (batch,) 0/1 mask of real sequences for the next forwards: padding rows
        # (zero-weight samples) then add no load-balancing gradient. Set by the train step.
        self.row_mask: torch.Tensor | None = None
        # What the last forward saw, for metrics (detached): the local sum over sequences of
        # the aux loss, and the tokens routed to each expert (counted once per top-k slot).
        self.last_aux_loss_sum: torch.Tensor | None = None
        self.last_num_sequences: int = 0
        self.last_tokens_per_expert: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seqlen, dim = x.shape
        flat = x.reshape(-1, dim)
        logits = F.linear(flat, _local(self.gate.weight))
        probs = torch.softmax(logits.float(), dim=-1)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        top_w = (top_w / top_w.sum(dim=-1, keepdim=True)).to(x.dtype)  # Mixtral renormalises

        aux = self._aux_per_sequence(probs.view(bs, seqlen, -1), top_i.view(bs, seqlen, -1))
        flat_expert = top_i.reshape(-1)
        counts = torch.bincount(flat_expert, minlength=self.num_experts)
        self.last_tokens_per_expert = counts.detach()
        self.last_aux_loss_sum = aux.detach().sum()
        self.last_num_sequences = bs

        # Group the (token, slot) pairs by expert; a stable sort keeps token order within an expert.
        order = torch.argsort(flat_expert, stable=True)
        token_of = order // self.top_k
        routed = flat[token_of]
        if self.ep_group is not None and dist.get_world_size(self.ep_group) > 1:
            y = self._experts_ep(routed, counts)
        else:
            y = self.experts(routed, counts.tolist())
        y = y * top_w.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros_like(flat).index_add_(0, token_of, y).view(bs, seqlen, dim)

        scale = self.aux_scale if self.aux_scale is not None else self.aux_loss_coef / max(bs, 1)
        if torch.is_grad_enabled() and scale != 0.0 and aux.requires_grad:
            weight = torch.full_like(aux, scale)
            if self.row_mask is not None and self.row_mask.shape[0] == bs:
                weight = weight * self.row_mask.to(weight)
            out = _AddAuxGrad.apply(out, aux, weight.detach())
        return out

    def _aux_per_sequence(self, probs: torch.Tensor, top_i: torch.Tensor) -> torch.Tensor:
        """E · Σ_i f_i · P_i for each sequence: (batch,), differentiable through P only.

        With context parallelism each rank holds part of every sequence: the routed counts
        and lengths are summed over the cp group, and each rank returns its share of P, so
        the shares add up to the full sequence's loss.
        """
        bs, seqlen, n_exp = probs.shape
        counts = torch.zeros(bs, n_exp, device=probs.device, dtype=torch.float32)
        counts.scatter_add_(1, top_i.reshape(bs, -1), torch.ones(bs, seqlen * self.top_k, device=probs.device))
        length = torch.full((bs, 1), float(seqlen), device=probs.device)
        if self.cp_group is not None and dist.get_world_size(self.cp_group) > 1:
            both = torch.cat([counts, length], dim=1)
            dist.all_reduce(both, group=self.cp_group)
            counts, length = both[:, :n_exp], both[:, n_exp:]
        frac_routed = counts / (length * self.top_k)
        prob_share = probs.sum(dim=1) / length
        return n_exp * (frac_routed * prob_share).sum(dim=-1)

    def _experts_ep(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Send each row to the rank owning its expert, run the local experts, send results back."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        group = self.ep_group
        world = dist.get_world_size(group)
        n_local = self.num_experts // world
        # counts[e] rows go to rank e // n_local; learn how many rows each peer sends us, per expert.
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)
        send = counts.view(world, n_local).sum(dim=1).tolist()
        recv_grid = recv_counts.view(world, n_local).cpu()  # [source rank, local expert]: the host sync
        recv = recv_grid.sum(dim=1).tolist()
        got = all_to_all_single_autograd(routed, recv, send, group)
        # Arrived ordered by (source, expert); the experts want (expert, source).
        starts = torch.cumsum(recv_grid.flatten(), 0) - recv_grid.flatten()
        starts = starts.view(world, n_local)
        perm = [
            torch.arange(int(starts[s, e]), int(starts[s, e] + recv_grid[s, e]))
            for e in range(n_local)
            for s in range(world)
        ]
        perm_t = torch.cat(perm).to(routed.device) if perm else torch.zeros(0, dtype=torch.long)
        y = self.experts(got[perm_t], recv_grid.sum(dim=0).tolist())
        y = y[torch.argsort(perm_t)]
        return all_to_all_single_autograd(y, send, recv, group)


def moe_modules(modules: nn.Module | list[nn.Module]) -> list[MoE]:
    parts = modules if isinstance(modules, list) else [modules]
    return [m for part in parts for m in part.modules() if isinstance(m, MoE)]


def set_aux_scale(modules: nn.Module | list[nn.Module], scale: float | None) -> None:
    """Weight of one sequence's aux loss: pass coef / (sequences in the global batch)."""
    for m in moe_modules(modules):
        m.aux_scale = scale


def set_row_mask(modules: nn.Module | list[nn.Module], mask: torch.Tensor | None) -> None:
    """Mark the real (1) and padding (0) sequences of the next micro-batch; None: all real."""
    for m in moe_modules(modules):
        m.row_mask = mask


def moe_stats(modules: nn.Module | list[nn.Module]) -> dict[str, torch.Tensor]:
    """Local sums from the last forward, to be summed over ranks by the caller.

    `aux_loss_sum`: Σ over MoE layers and local sequences of the aux loss (divide by the global
    number of sequences for the mean); `tokens_per_expert`: (layers, experts) routed counts.
    """
    ms = [m for m in moe_modules(modules) if m.last_tokens_per_expert is not None]
    if not ms:
        return {}
    return {
        "aux_loss_sum": torch.stack([m.last_aux_loss_sum for m in ms]).sum(),
        "tokens_per_expert": torch.stack([m.last_tokens_per_expert.float() for m in ms]),
    }


def global_moe_metrics(model: nn.Module, n_layers: int, cp: int = 1) -> dict[str, float]:
    """Aux loss and load imbalance of the last micro-batch of every rank, over the whole world
    (a collective: call on every rank). Each pipeline rank fills in its own layers; context
    parallel ranks hold shares of the same sequences, so their sequence counts are divided by cp.

    Returns {"moe_aux_loss": mean per layer and sequence, "moe_load_imbalance": max/mean
    tokens per expert averaged over layers (1.0 is perfectly balanced)}.
    """
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
    if not found:
        return {}
    n_exp = found[0][1].num_experts
    device = next(model.parameters()).device
    tokens = torch.zeros(n_layers, n_exp, device=device)
    sums = torch.zeros(2, device=device)  # aux sum, (layer, sequence) count
    for name, m in found:
        if m.last_tokens_per_expert is None or m.last_aux_loss_sum is None:
            continue
        layer = int(canonical_name(name).split(".")[1])
        tokens[layer] = m.last_tokens_per_expert.float().to(device)
        sums[0] += m.last_aux_loss_sum.float().to(device)
        sums[1] += m.last_num_sequences / cp
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tokens)
        dist.all_reduce(sums)
    used = tokens.sum(dim=-1) > 0
    return {
        "moe_aux_loss": float(sums[0] / sums[1].clamp_min(1e-9)),
        "moe_load_imbalance": load_imbalance(tokens[used]) if bool(used.any()) else 1.0,
    }


def load_imbalance(tokens_per_expert: torch.Tensor) -> float:
    """max / mean tokens per expert, averaged over layers (1.0 when perfectly balanced)."""
    mean = tokens_per_expert.mean(dim=-1).clamp_min(1e-9)
    return float((tokens_per_expert.max(dim=-1).values / mean).mean())
