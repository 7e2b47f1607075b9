"""A Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU; with the
features of the Qwen families as options: q/k/v biases (Qwen2), an RMSNorm of each q/k head before
the rotary embedding and a head width of its own (Qwen3). Mistral is Llama's shape.

Written so the parallel layouts can rewrite it in place, as torchtitan does:
- head counts are read from the tensors at run time (`view(..., -1, head_dim)`), so a
  tensor-parallel split of wq/wk/wv needs no change here;
- `layers` is a ModuleDict keyed by the global layer index, so a pipeline stage can drop
  the layers it does not own and keep the names that checkpoints use;
- `tok_embeddings`, `norm` and `output` may be None on a pipeline stage that lacks them;
- attention takes global `positions`, and its kernel is a replaceable attribute, so context
  parallelism can shard the sequence (zigzag) and swap in ring attention;
- packed documents: `doc_ids` (batch, seq) gives each position's document, and attention then
  stays inside it (a kernel gets them as `doc_ids=`; every kernel accepts it). Rotary embeddings
  are relative, so positions need not restart at each document;
- rotary embeddings use the "rotate half" convention, so Hugging Face Llama weights map
  one-to-one with no permutation.

Weights come from `init_weights(model, seed)`: every parameter is drawn from its own
generator seeded by (seed, name), so any layout — sharded or not — starts from identical values.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from parallel.config import ModelConfig
from parallel.moe import MoE
from parallel.param_names import canonical_name

# attn_fn(q, k, v, doc_ids=None): q/k/v (batch, heads, seq, head_dim), doc_ids (batch, seq) or None.
AttentionFn = Callable[..., torch.Tensor]


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) bool: causal, and only within the same document."""
    seq = doc_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=doc_ids.device).tril()
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal).unsqueeze(1)


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention over (batch, heads, seq, head_dim); k/v already expanded to q's heads.
    With doc_ids (batch, seq), each position sees only earlier positions of its own document."""
    if doc_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(doc_ids))


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    t = torch.arange(max_seq_len, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float(), emb.sin().float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, seq, heads, head_dim); cos/sin: (batch or 1, seq, head_dim)."""
    cos = cos.unsqueeze(2).to(x.dtype)
    sin = sin.unsqueeze(2).to(x.dtype)
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.n_rep = cfg.n_heads // cfg.kv_heads
        bias = bool(cfg.qkv_bias)
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=bias)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=bias)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        # Qwen3: each head's q and k normalised over head_dim (one weight shared by the heads).
        self.q_norm: nn.RMSNorm | None = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm: nn.RMSNorm | None = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.attn_fn: AttentionFn = causal_sdpa

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_rep > 1:
            k = k.repeat_interleave(self.n_rep, dim=2)
            v = v.repeat_interleave(self.n_rep, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = self.attn_fn(q, k, v) if doc_ids is None else self.attn_fn(q, k, v, doc_ids=doc_ids)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.moe_enabled = cfg.is_moe_layer(layer_id)
        if self.moe_enabled:
            self.feed_forward: nn.Module = MoE(cfg)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, doc_ids=doc_ids)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        # Not persistent: derived from the config, never part of a checkpoint.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: (batch, seq) ids on the first stage, else (batch, seq, dim) hidden states.

        positions: (seq,) or (batch, seq) global positions; default 0..seq-1.
        doc_ids: (batch, full seq) document of each position (attention stays inside each); None:
        plain causal. Under context parallelism it covers the whole sequence, not the local shard.
        Returns logits (batch, seq, vocab) on the last stage, else hidden states.
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        seqlen = tokens.shape[1]  # the full length: under sequence parallelism h holds a shard
        if positions is None:
            positions = torch.arange(seqlen, device=h.device)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        if cos.dim() == 2:
            cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
        for layer in self.layers.values():
            h = layer(h, cos, sin) if doc_ids is None else layer(h, cos, sin, doc_ids=doc_ids)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def num_params(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embedding and self.tok_embeddings is not None:
            n -= self.tok_embeddings.weight.numel()
        return n


def build_model(cfg: ModelConfig, device: torch.device | str = "meta") -> Transformer:
    """Build on `device` (meta by default: no memory until a layout materialises it)."""
    with torch.device(device):
        model = Transformer(cfg)
    if cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model


def _param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _init_value(name: str, shape: torch.Size, cfg: ModelConfig, seed: int) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed(_param_seed(seed, name))
    std = 0.02
    if name.endswith(("wo.weight", "w2.weight", "experts.w2")):
        std = 0.02 / math.sqrt(2 * cfg.n_layers)  # residual projections, as in GPT-2/Llama
    elif name.endswith("output.weight"):
        std = cfg.dim**-0.5
    return torch.randn(shape, generator=gen) * std


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig, seed: int | None = None, device: torch.device | str | None = None,
                 *, values: bool = True) -> None:  # fmt: skip
    """Give every parameter its seeded value, whatever the layout.

    Works on plain tensors and on DTensors (FSDP/TP shards): the full value is drawn on the
    host from a per-parameter generator and each rank keeps its own shard, so no
    communication is needed and a sharded model equals the single-process one exactly.
    Parameters on the meta device are materialised on `device` first. values=False: only that
    (with the RoPE tables and the tied output), for a model whose whole state is loaded next.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    seed = cfg.init_seed if seed is None else seed
    if device is not None and any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        for m in model.modules():
            if isinstance(m, Transformer):
                m.rope_cos, m.rope_sin = cos.to(device), sin.to(device)
                # to_empty gives each module its own tensor: tie the output to the embedding again.
                if cfg.tie_embeddings and m.tok_embeddings is not None and m.output is not None:
                    m.output.weight = m.tok_embeddings.weight
    if not values:
        return
    for name, p in model.named_parameters(remove_duplicate=True):
        canonical = canonical_name(name)
        full = _init_value(canonical, p.shape, cfg, seed)
        if isinstance(p, DTensor):
            local = distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(local.to_local())
        else:
            p.copy_(full.to(p.dtype))
