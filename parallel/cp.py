"""Context parallelism: the sequence is sharded over the cp ranks; attention runs as a ring.

Each rank keeps its queries and passes its keys/values around the ring (`batch_isend_irecv`);
the partial results of every key/value block are merged with their log-sum-exp, so the
result equals full causal attention. The causal mask comes from the global positions of
the tokens, which lets the sequence be sharded "zigzag": the sequence is cut into 2·cp
chunks and rank r holds chunks r and 2·cp−1−r, so every rank does the same amount of work
under the causal mask. With document ids (packed documents, `data.document_mask`) each rank holds
the whole sequence's ids, so every block's mask also keeps queries to their own document; no
extra communication is needed. Key/value half-blocks that the causal mask hides entirely are skipped, and
the next block's transfer is posted before the current block is computed, so communication
overlaps compute.

On CUDA `parallelism.cp_impl: builtin` uses torch's own `context_parallel` instead (it has
no CPU kernel, so there it is refused with a clear error).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

Layout = Literal["zigzag", "contiguous"]

# ---------------------------------------------------------------------------------------------
# Sharding of the inputs


def _segments(seq_len: int, rank: int, world: int, layout: Layout) -> list[tuple[int, int]]:
    """The local shard as (first global position, length) runs, in local order."""
    if layout == "contiguous":
        if seq_len % world:
            raise ValueError(f"training.seq_len={seq_len} must be divisible by parallelism.cp={world}")
        n = seq_len // world
        return [(rank * n, n)]
    if seq_len % (2 * world):
        raise ValueError(
            f"training.seq_len={seq_len} must be divisible by 2·parallelism.cp={2 * world} "
            "for zigzag context parallelism; change seq_len or cp"
        )
    c = seq_len // (2 * world)
    return [(rank * c, c), ((2 * world - 1 - rank) * c, c)]


def cp_positions(seq_len: int, rank: int, world: int, layout: Layout = "zigzag") -> torch.Tensor:
    """Global positions (local_len,) of the tokens that `rank` holds of a `seq_len` sequence."""
    return torch.cat([torch.arange(s, s + n) for s, n in _segments(seq_len, rank, world, layout)])


def shard_sequence(x: torch.Tensor, rank: int, world: int, dim: int = 1, layout: Layout = "zigzag") -> torch.Tensor:
    """The part of `x` (full sequence along `dim`) that cp rank `rank` holds."""
    segs = _segments(x.shape[dim], rank, world, layout)
    return torch.cat([x.narrow(dim, s, n) for s, n in segs], dim=dim)


def unshard_sequence(parts: list[torch.Tensor], dim: int = 1, layout: Layout = "zigzag") -> torch.Tensor:
    """Inverse of `shard_sequence` given every rank's part, in rank order (for tests and tools)."""
    world = len(parts)
    seq_len = sum(p.shape[dim] for p in parts)
    out = torch.empty_like(torch.cat(parts, dim=dim))
    for r, p in enumerate(parts):
        off = 0
        for s, n in _segments(seq_len, r, world, layout):
            out.narrow(dim, s, n).copy_(p.narrow(dim, off, n))
            off += n
    return out


def shard_batch(
    tokens: torch.Tensor, labels: torch.Tensor, rank: int, world: int, layout: Layout = "zigzag"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, labels, positions) of this cp rank; tokens/labels are (batch, seq)."""
    seq_len = tokens.shape[1]
    return (
        shard_sequence(tokens, rank, world, 1, layout),
        shard_sequence(labels, rank, world, 1, layout),
        cp_positions(seq_len, rank, world, layout).to(tokens.device),
    )


# ---------------------------------------------------------------------------------------------
# Ring attention


def _ring_exchange(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> tuple[list[torch.Tensor], list[Any]]:
    """Post: send `tensors` to the next rank, receive the previous rank's into new buffers."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    nxt = dist.get_global_rank(group, (rank + 1) % world)
    prv = dist.get_global_rank(group, (rank - 1) % world)
    bufs = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, b, prv, group) for b in bufs]
    return bufs, dist.batch_isend_irecv(ops)


def _wait(works: list[Any]) -> None:
    for w in works:
        w.wait()


def _block_pairs(
    q_segs: list[tuple[int, int]], kv_segs: list[tuple[int, int]], doc_ids: torch.Tensor | None = None
) -> Iterator[tuple[slice, slice, torch.Tensor | None]]:
    """(query rows, key rows, mask or None) for each visible half-block; hidden ones are skipped.

    The mask is (q, k), or (batch, 1, q, k) with doc_ids (batch, whole seq) given."""
    q_off = 0
    for qs, qn in q_segs:
        k_off = 0
        for ks, kn in kv_segs:
            if ks <= qs + qn - 1:  # else every key is after every query: hidden, skipped
                mask = None
                if ks + kn - 1 > qs:  # some keys are after some queries: causal mask
                    mask = torch.arange(qs, qs + qn)[:, None] >= torch.arange(ks, ks + kn)[None, :]
                if doc_ids is not None:
                    same = doc_ids[:, qs : qs + qn, None] == doc_ids[:, None, ks : ks + kn]
                    mask = (same if mask is None else same & mask.to(same.device)).unsqueeze(1)
                yield slice(q_off, q_off + qn), slice(k_off, k_off + kn), mask
            k_off += kn
        q_off += qn


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, layout: Layout,
        doc_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        seq_len = q.shape[2] * world
        scale = 1.0 / math.sqrt(q.shape[-1])
        q_segs = _segments(seq_len, rank, world, layout)
        qf = q.float()
        out = torch.zeros_like(qf)
        lse = torch.full(q.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
        cur_k, cur_v = k.contiguous(), v.contiguous()
        for step in range(world):
            src = (rank - step) % world
            works: list[Any] = []
            if step < world - 1:  # post the next block's transfer first, then compute this one
                (nk, nv), works = _ring_exchange([cur_k, cur_v], group)
            kf, vf = cur_k.float(), cur_v.float()
            for qi, ki, mask in _block_pairs(q_segs, _segments(seq_len, src, world, layout), doc_ids):
                s = (qf[:, :, qi] @ kf[:, :, ki].transpose(-1, -2)) * scale
                if mask is not None:
                    s = s.masked_fill(~mask.to(s.device), -math.inf)
                blse = torch.logsumexp(s, dim=-1)
                bout = torch.nan_to_num(torch.exp(s - blse.unsqueeze(-1))) @ vf[:, :, ki]
                new = torch.logaddexp(lse[:, :, qi], blse)
                w_old = torch.nan_to_num(torch.exp(lse[:, :, qi] - new)).unsqueeze(-1)
                w_new = torch.nan_to_num(torch.exp(blse - new)).unsqueeze(-1)
                out[:, :, qi] = out[:, :, qi] * w_old + bout * w_new
                lse[:, :, qi] = new
            if works:
                _wait(works)
                cur_k, cur_v = nk, nv
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.layout, ctx.scale, ctx.doc_ids = group, layout, scale, doc_ids
        return out.to(q.dtype)

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None, None]:
        q, k, v, out, lse = ctx.saved_tensors
        group, layout, scale, doc_ids = ctx.group, ctx.layout, ctx.scale, ctx.doc_ids
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        seq_len = q.shape[2] * world
        q_segs = _segments(seq_len, rank, world, layout)
        qf, do = q.float(), grad_out.float()
        delta = (do * out).sum(dim=-1)  # rowsum(dO ∘ O), as in flash attention's backward
        dq = torch.zeros_like(qf)
        cur_k, cur_v = k.contiguous(), v.contiguous()
        # dk/dv of a block travel with it around the ring and arrive home after the last step.
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for step in range(world):
            src = (rank - step) % world
            works: list[Any] = []
            if step < world - 1:
                (nk, nv), works = _ring_exchange([cur_k, cur_v], group)
            kf, vf = cur_k.float(), cur_v.float()
            for qi, ki, mask in _block_pairs(q_segs, _segments(seq_len, src, world, layout), doc_ids):
                s = (qf[:, :, qi] @ kf[:, :, ki].transpose(-1, -2)) * scale
                p = torch.exp(s - lse[:, :, qi].unsqueeze(-1))
                if mask is not None:
                    p = p.masked_fill(~mask.to(p.device), 0.0)
                dv[:, :, ki] += p.transpose(-1, -2) @ do[:, :, qi]
                dp = do[:, :, qi] @ vf[:, :, ki].transpose(-1, -2)
                ds = p * (dp - delta[:, :, qi].unsqueeze(-1)) * scale
                dq[:, :, qi] += ds @ kf[:, :, ki]
                dk[:, :, ki] += ds.transpose(-1, -2) @ qf[:, :, qi]
            if world > 1:
                (dk, dv), dworks = _ring_exchange([dk, dv], group)
                _wait(dworks)
            if works:
                _wait(works)
                cur_k, cur_v = nk, nv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None, *,
    group: dist.ProcessGroup, layout: Layout = "zigzag",
) -> torch.Tensor:
    """Causal attention over the whole sequence; q/k/v: (batch, heads, local_seq, head_dim)
    holding this rank's shard (as `shard_sequence` cuts it). Returns this rank's output rows.
    doc_ids: (batch, whole seq) documents of the packed sequence, unsharded; attention stays inside each."""
    return _RingAttention.apply(q, k, v, group, layout, doc_ids)


# ---------------------------------------------------------------------------------------------
# Applying it to a model


def apply_cp(
    model: nn.Module | list[nn.Module],
    cp_mesh: Any,
    impl: Literal["ring", "builtin"] = "ring",
    layout: Layout = "zigzag",
) -> None:
    """Make every attention layer of `model` (or of each pipeline stage) context-parallel.

    cp_mesh: the 1-D "cp" DeviceMesh (or a ProcessGroup). The inputs must then be sharded with
    `shard_batch` (ring) and the model called with the returned positions. MoE layers learn the
    cp group so their per-sequence load-balancing statistics cover the whole sequence.
    """
    from parallel.model import Attention, causal_sdpa
    from parallel.moe import MoE

    group = cp_mesh.get_group() if hasattr(cp_mesh, "get_group") else cp_mesh
    parts = model if isinstance(model, list) else [model]
    if impl == "builtin":
        device_type = getattr(cp_mesh, "device_type", "cpu")
        if device_type != "cuda":
            raise ValueError(
                "parallelism.cp_impl=builtin needs CUDA (torch's context_parallel has no CPU attention "
                "kernel); use cp_impl: ring on this machine"
            )
        attn_fn: Any = causal_sdpa  # builtin CP patches SDPA itself inside `builtin_cp_context`
    elif impl == "ring":
        attn_fn = functools.partial(ring_attention, group=group, layout=layout)
    else:
        raise ValueError(f"parallelism.cp_impl={impl!r} is unknown; use ring or builtin")
    for part in parts:
        for m in part.modules():
            if isinstance(m, Attention):
                m.attn_fn = attn_fn
            elif isinstance(m, MoE):
                m.cp_group = group


@contextlib.contextmanager
def builtin_cp_context(
    cp_mesh: Any, buffers: list[torch.Tensor], seq_dims: list[int]
) -> Iterator[None]:
    """torch's built-in context parallelism (CUDA only): shards `buffers` in place along
    `seq_dims` and runs SDPA as ring attention inside the block (forward and backward)."""
    if getattr(cp_mesh, "device_type", "cpu") != "cuda":
        raise ValueError("parallelism.cp_impl=builtin needs CUDA; use cp_impl: ring on this machine")
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method("alltoall")
    with context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=seq_dims):
        yield
