"""Hugging Face interop for the MoE family: our MoE models to and from `MixtralForCausalLM` folders.

The on-disk Mixtral layout (what `from_pretrained` reads, in transformers 4.x and 5.x alike):
`model.layers.{i}.block_sparse_moe.gate.weight` (experts, dim) and
`model.layers.{i}.block_sparse_moe.experts.{e}.w1|w2|w3.weight`, one `nn.Linear` weight per
expert. Our experts are stacked `(experts, ...)` tensors laid out like those weights, so an
expert is one slice; attention, norms, embeddings and the head are named as in Llama
(`parallel.hf`). The router is Mixtral's (softmax, top-k, renormalised), so logits match.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallel.config import ModelConfig, MoEConfig
from parallel.hf import HFInteropError, decoder_config_dict, from_hf_name, model_config_from_hf, to_hf_name
from parallel.model import canonical_name

_MOE_RE = re.compile(r"^layers\.(\d+)\.feed_forward\.(gate\.weight|experts\.w[123])$")
_HF_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_HF_GATE_RE = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight$")


def _check_exportable(cfg: ModelConfig) -> MoEConfig:
    if cfg.moe is None:
        raise HFInteropError("model.moe is not set: dense models export with parallel.hf (LlamaForCausalLM)")
    if cfg.moe.every_n_layers != 1:
        raise HFInteropError(
            f"model.moe.every_n_layers={cfg.moe.every_n_layers}: Mixtral has experts in every layer; "
            "only every_n_layers: 1 exports"
        )
    if cfg.moe.hidden_dim is not None and cfg.moe.hidden_dim != cfg.ffn_dim:
        raise HFInteropError("model.moe.hidden_dim differs from the dense width, which Mixtral cannot express")
    return cfg.moe


def mixtral_config_dict(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The `config.json` of a MixtralForCausalLM with our model's shape."""
    moe = _check_exportable(cfg)
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        **decoder_config_dict(cfg, dtype),
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.aux_loss_coef,
        "output_router_logits": False,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
        "attention_dropout": 0.0,
    }


def model_config_from_mixtral(hf: dict[str, Any]) -> ModelConfig:
    """Our ModelConfig from a Mixtral `config.json`; refuses what our model cannot reproduce."""
    if hf.get("model_type") != "mixtral":
        raise HFInteropError(f"config.json model_type={hf.get('model_type')!r}: expected 'mixtral'")
    if hf.get("sliding_window"):
        raise HFInteropError(f"config.json sliding_window={hf['sliding_window']}: our attention is full causal")
    dense = model_config_from_hf({**hf, "model_type": "llama"})
    moe = MoEConfig(
        num_experts=hf["num_local_experts"], top_k=hf.get("num_experts_per_tok", 2),
        aux_loss_coef=hf.get("router_aux_loss_coef", 0.01),
    )
    return ModelConfig(**{**dense.model_dump(exclude={"moe", "preset"}), "moe": moe.model_dump()})


def to_mixtral_state(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full tensors in our naming -> Mixtral on-disk names (experts split per expert)."""
    moe = _check_exportable(cfg)
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        name = canonical_name(name)
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        t = t.detach().to("cpu")
        m = _MOE_RE.match(name)
        if m is None:
            out[to_hf_name(name)] = t.contiguous().clone()
        elif m.group(2) == "gate.weight":
            out[f"model.layers.{m.group(1)}.block_sparse_moe.gate.weight"] = t.contiguous().clone()
        else:
            which = m.group(2).split(".")[1]
            if t.shape[0] != moe.num_experts:
                raise HFInteropError(f"{name}: {t.shape[0]} experts in the state, model.moe says {moe.num_experts}")
            for e in range(moe.num_experts):
                out[f"model.layers.{m.group(1)}.block_sparse_moe.experts.{e}.{which}.weight"] = t[e].contiguous().clone()
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


def export_mixtral(state: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str) -> None:
    """Write `state` (full tensors in our naming) as a folder `from_pretrained` loads as MixtralForCausalLM."""
    from safetensors.torch import save_file

    config = mixtral_config_dict(cfg)
    from parallel.model import build_model

    expected = {n for n, _ in build_model(cfg).named_parameters()}
    have = {canonical_name(k) for k in state}
    if expected - have:
        raise HFInteropError(f"the state lacks {len(expected - have)} tensors, e.g. {sorted(expected - have)[:3]}")
    out = to_mixtral_state({k: v for k, v in state.items() if canonical_name(k) in expected}, cfg)
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    dtypes = {t.dtype for t in out.values()}
    dtype_name = str(dtypes.pop() if len(dtypes) == 1 else torch.float32).removeprefix("torch.")
    config.update(torch_dtype=dtype_name, dtype=dtype_name)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def load_mixtral_state_dict(path: str) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """Read a Mixtral folder into (full tensors in our naming, our ModelConfig)."""
    from safetensors.torch import load_file

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise HFInteropError(f"{str(folder)!r} has no config.json: point at a Mixtral model folder")
    cfg = model_config_from_mixtral(json.loads((folder / "config.json").read_text(encoding="utf-8")))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise HFInteropError(f"{str(folder)!r} has no model.safetensors: only safetensors weights are read")
    hf_state: dict[str, torch.Tensor] = {}
    for f in files:
        hf_state.update(load_file(str(folder / f)))
    return from_mixtral_state(hf_state, cfg), cfg


@torch.no_grad()
def load_mixtral_weights(model: nn.Module, cfg: ModelConfig, path: str) -> None:
    """Copy a Mixtral folder's weights into `model` (sharded, expert-parallel or a pipeline stage):
    each rank keeps its own shard of the full tensors, with no communication."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    state, hf_cfg = load_mixtral_state_dict(path)
    for field in ("vocab_size", "dim", "n_layers", "n_heads", "kv_heads", "ffn_dim", "tie_embeddings"):
        if getattr(cfg, field) != getattr(hf_cfg, field):
            raise HFInteropError(
                f"model.init_from={path!r}: model.{field} is {getattr(cfg, field)} in the job but "
                f"{getattr(hf_cfg, field)} in the checkpoint; set it to match"
            )
    assert cfg.moe is not None and hf_cfg.moe is not None
    if cfg.moe.num_experts != hf_cfg.moe.num_experts:
        raise HFInteropError(
            f"model.moe.num_experts={cfg.moe.num_experts} but the checkpoint has {hf_cfg.moe.num_experts}; set it to match"
        )
    for name, p in model.named_parameters(remove_duplicate=True):
        canonical = canonical_name(name)
        if canonical not in state:
            raise HFInteropError(f"model.init_from={path!r} has no tensor for parameter {canonical!r}")
        full = state[canonical]
        if tuple(full.shape) != tuple(p.shape):
            raise HFInteropError(f"{canonical!r}: checkpoint shape {tuple(full.shape)} != model shape {tuple(p.shape)}")
        if isinstance(p, DTensor):
            local = distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(local.to_local())
        else:
            p.copy_(full.to(device=p.device, dtype=p.dtype))
