"""Parameter counts of the Llama/Mixtral model in parallel/model.py, from its config alone.

Counted the way the model is built: per layer wq/wo (dim x n_heads·head_dim), wk/wv
(dim x kv_heads·head_dim), SwiGLU w1/w2/w3, two RMSNorms; the embedding, the final norm and
the output projection (shared with the embedding when tied). A MoE layer has a router
(dim x num_experts) and num_experts SwiGLU experts of the expert width.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel.config import ModelConfig


@dataclass(frozen=True)
class ParamCounts:
    embedding: int  # tok_embeddings
    output: int  # output projection (0 when tied to the embedding)
    final_norm: int
    attention: int  # per layer: wq, wk, wv, wo
    norms: int  # per layer: attention_norm + ffn_norm
    dense_mlp: int  # per dense layer
    router: int  # per MoE layer
    expert: int  # one expert's SwiGLU
    num_experts: int
    top_k: int
    n_layers: int
    n_moe_layers: int

    @property
    def n_dense_layers(self) -> int:
        return self.n_layers - self.n_moe_layers

    @property
    def layer_dense(self) -> int:
        """A dense layer's parameters."""
        return self.attention + self.norms + self.dense_mlp

    @property
    def layer_moe_shared(self) -> int:
        """A MoE layer's parameters outside its experts (replicated across EP ranks)."""
        return self.attention + self.norms + self.router

    @property
    def experts_per_layer(self) -> int:
        return self.expert * self.num_experts

    @property
    def total(self) -> int:
        return (
            self.embedding + self.output + self.final_norm
            + self.n_dense_layers * self.layer_dense
            + self.n_moe_layers * (self.layer_moe_shared + self.experts_per_layer)
        )

    @property
    def experts_total(self) -> int:
        return self.n_moe_layers * self.experts_per_layer

    @property
    def active(self) -> int:
        """Parameters one token touches: top_k experts of each MoE layer."""
        return self.total - self.n_moe_layers * self.expert * (self.num_experts - self.top_k)

    @property
    def flops_params(self) -> int:
        """N of 6·N: active parameters without the input embedding (a lookup, no matmul), as torchtitan
        counts; a tied output projection is still a matmul, so it stays counted."""
        tied_output = self.embedding if self.output == 0 else 0
        return self.active - self.embedding + tied_output


def count_params(cfg: ModelConfig) -> ParamCounts:
    h, hd = cfg.dim, cfg.head_dim
    attention = h * cfg.n_heads * hd * 2 + h * cfg.kv_heads * hd * 2
    n_moe = 0
    num_experts, top_k, router, expert = 0, 0, 0, 0
    if cfg.moe is not None:
        n_moe = sum(1 for i in range(cfg.n_layers) if cfg.is_moe_layer(i))
        num_experts, top_k = cfg.moe.num_experts, cfg.moe.top_k
        router = h * num_experts
        expert = 3 * h * (cfg.moe.hidden_dim or cfg.ffn_dim)
    return ParamCounts(
        embedding=cfg.vocab_size * h,
        output=0 if cfg.tie_embeddings else cfg.vocab_size * h,
        final_norm=h,
        attention=attention,
        norms=2 * h,
        dense_mlp=3 * h * cfg.ffn_dim,
        router=router,
        expert=expert,
        num_experts=num_experts,
        top_k=top_k,
        n_layers=cfg.n_layers,
        n_moe_layers=n_moe,
    )
