"""Training FLOPs per token, torchtitan's definition: 6·N + 12·L·H·Q·T.

N counts the parameters a token's matmuls touch (active parameters for MoE, the input
embedding excluded: it is a lookup); the attention term covers QK^T and AV over the full
sequence T (no causal halving), forward and backward, for L layers, H heads of width Q.
"""

from __future__ import annotations

from parallel.config import ModelConfig
from parallel.planner.params import count_params
from parallel.planner.terms import Term, g


def flops_per_token(model: ModelConfig, seq_len: int) -> float:
    return flops_per_token_term(model, seq_len).value


def flops_per_token_term(model: ModelConfig, seq_len: int) -> Term:
    n = count_params(model).flops_params
    lyr, h, q = model.n_layers, model.n_heads, model.head_dim
    dense = 6 * n
    attn = 12 * lyr * h * q * seq_len
    return Term(
        "flops/token", dense + attn, "6·N + 12·L·H·Q·T",
        f"6 × {g(n)} + 12 × {lyr} × {h} × {q} × {seq_len} = {g(dense)} + {g(attn)} = {g(dense + attn)}",
    )


def recompute_flops_per_token(model: ModelConfig, seq_len: int, ac: str) -> Term:
    """Extra FLOPs activation checkpointing spends: full AC reruns each layer's forward (2·N_layers +
    the forward attention 4·L·H·Q·T); the engine's selective AC checkpoints every other block
    (parallel/ac.py), so it reruns ⌈L/2⌉/L of that."""
    lyr, h, q = model.n_layers, model.n_heads, model.head_dim
    if ac == "none":
        return Term("recompute flops/token", 0.0, "0 (no activation checkpointing)", "0")
    pc = count_params(model)
    n_layers = pc.flops_params - pc.output - (pc.embedding if pc.output == 0 else 0)
    full = 2 * n_layers + 4 * lyr * h * q * seq_len
    share = 1.0 if ac == "full" else ((lyr + 1) // 2) / lyr
    v = full * share
    return Term("recompute flops/token", v, "(2·N_layers + 4·L·H·Q·T) × checkpointed share",
                f"(2 × {g(n_layers)} + 4 × {lyr} × {h} × {q} × {seq_len}) × {share:g} = {g(v)}")
