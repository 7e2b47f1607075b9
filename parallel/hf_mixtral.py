"""The Mixtral family: our MoE models to and from `MixtralForCausalLM` folders.

The on-disk Mixtral layout (what `from_pretrained` reads, in transformers 4.x and 5.x alike):
`model.layers.{i}.block_sparse_moe.gate.weight` (experts, dim) and
`model.layers.{i}.block_sparse_moe.experts.{e}.w1|w2|w3.weight`, one `nn.Linear` weight per
expert. Our experts are stacked `(experts, ...)` tensors laid out like those weights, so an
expert is one slice; attention, norms, embeddings and the head are named as in Llama
(`parallel.hf_common`). The router is Mixtral's (softmax, top-k, renormalised), so logits match.
Export goes through parallel.hf.export_hf, as for every family (this module does not import it).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from parallel.config import ModelConfig, MoEConfig
from parallel.hf_common import (
    HFFamily,
    HFInteropError,
    copy_into,
    decoder_config_dict,
    from_hf_name,
    full_state,
    read_folder,
    refuse_sliding_window,
    to_hf_name,
)

_MOE_RE = re.compile(r"^layers\.(\d+)\.feed_forward\.(gate\.weight|experts\.w[123])$")
_HF_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_HF_GATE_RE = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight$")


def _check_exportable(cfg: ModelConfig) -> MoEConfig:
    if cfg.moe is None:
        raise HFInteropError("model.moe is not set: dense models export as their own family (Llama, Qwen, ...)")
    if cfg.moe.every_n_layers != 1:
        raise HFInteropError(
            f"model.moe.every_n_layers={cfg.moe.every_n_layers}: Mixtral has experts in every layer; "
            "only every_n_layers: 1 exports"
        )
    if cfg.moe.hidden_dim is not None and cfg.moe.hidden_dim != cfg.ffn_dim:
        raise HFInteropError("model.moe.hidden_dim differs from the dense width, which Mixtral cannot express")
    return cfg.moe


def _mixtral_config(cfg: ModelConfig) -> dict[str, Any]:
    moe = _check_exportable(cfg)
    return {
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.aux_loss_coef,
        "output_router_logits": False,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
        "attention_dropout": 0.0,
    }


def mixtral_config_dict(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The `config.json` of a MixtralForCausalLM with our model's shape."""
    extra = _mixtral_config(cfg)
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **decoder_config_dict(cfg, dtype),
            **extra}


def _read_mixtral(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("sliding_window"):
        raise HFInteropError(f"config.json sliding_window={hf['sliding_window']}: our attention is full causal")
    refuse_sliding_window(hf, "mixtral")
    moe = MoEConfig(
        num_experts=hf["num_local_experts"], top_k=hf.get("num_experts_per_tok", 2),
        aux_loss_coef=hf.get("router_aux_loss_coef", 0.01),
    )
    return {"moe": moe.model_dump()}


def model_config_from_mixtral(hf: dict[str, Any]) -> ModelConfig:
    """Our ModelConfig from a Mixtral `config.json`; refuses what our model cannot reproduce."""
    from parallel.hf_common import decoder_fields

    if hf.get("model_type") != "mixtral":
        raise HFInteropError(f"config.json model_type={hf.get('model_type')!r}: expected 'mixtral'")
    return ModelConfig(**decoder_fields(hf), **_read_mixtral(hf), family="mixtral")


def to_mixtral_state(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full tensors in our naming -> Mixtral on-disk names (experts split per expert)."""
    moe = _check_exportable(cfg)
    out: dict[str, torch.Tensor] = {}
    for name, t in full_state(state).items():
        m = _MOE_RE.match(name)
        if m is None:
            out[to_hf_name(name)] = t
        elif m.group(2) == "gate.weight":
            out[f"model.layers.{m.group(1)}.block_sparse_moe.gate.weight"] = t
        else:
            which = m.group(2).split(".")[1]
            if t.shape[0] != moe.num_experts:
                raise HFInteropError(f"{name}: {t.shape[0]} experts in the state, model.moe says {moe.num_experts}")
            for e in range(moe.num_experts):
                out[f"model.layers.{m.group(1)}.block_sparse_moe.experts.{e}.{which}.weight"] = t[e]
    return out


def from_mixtral_state(hf_state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Mixtral on-disk tensors -> our naming (experts stacked); ignores tensors we do not use."""
    moe = _check_exportable(cfg)
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in hf_state.items():
        if m := _HF_EXPERT_RE.match(name):
            experts.setdefault((int(m.group(1)), m.group(3)), {})[int(m.group(2))] = t
        elif m := _HF_GATE_RE.match(name):
            out[f"layers.{m.group(1)}.feed_forward.gate.weight"] = t
        elif (ours := from_hf_name(name)) is not None:
            out[ours] = t
    for (layer, which), per_expert in experts.items():
        missing = sorted(set(range(moe.num_experts)) - per_expert.keys())
        if missing:
            raise HFInteropError(f"layer {layer} {which}: experts {missing} are missing from the checkpoint")
        out[f"layers.{layer}.feed_forward.experts.{which}"] = torch.stack([per_expert[e] for e in range(moe.num_experts)])
    return out


MIXTRAL = HFFamily("mixtral", "mixtral", "MixtralForCausalLM", _mixtral_config, _read_mixtral,
                   to_hf_state=to_mixtral_state, from_hf_state=from_mixtral_state)


def load_mixtral_state_dict(path: str) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """Read a Mixtral folder into (full tensors in our naming, our ModelConfig)."""
    config, tensors = read_folder(path)
    cfg = model_config_from_mixtral(config)
    return from_mixtral_state(tensors, cfg), cfg


@torch.no_grad()
def load_mixtral_weights(model: nn.Module, cfg: ModelConfig, path: str) -> None:
    """Copy a Mixtral folder's weights into `model` (sharded, expert-parallel or a pipeline stage):
    each rank keeps its own shard of the full tensors, with no communication."""
    state, hf_cfg = load_mixtral_state_dict(path)
    copy_into(model, cfg, state, hf_cfg, path)
