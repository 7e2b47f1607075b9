"""What every Hugging Face family shares: tensor names, config.json fields, folder I/O, loading into a model.

Our rotary embeddings use the "rotate half" convention, as HF Llama, Mistral and Qwen do, so every
dense tensor maps one-to-one by name with no permutation. A family (`HFFamily`, defined in
parallel.hf_llama, parallel.hf_qwen, parallel.hf_mixtral and gathered by parallel.hf) adds its
config.json fields, what it refuses on import, and — for Mixtral's experts — its own tensor layout.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallel.config import ModelConfig
from parallel.param_names import canonical_name

# Our names -> HF names, per layer; the layer index is filled in. Biases and q/k norms exist only in
# the families that have them (the model's own parameter list says which are expected).
LAYER_MAP: dict[str, str] = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
TOP_MAP: dict[str, str] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_LAYER_MAP = {v: k for k, v in LAYER_MAP.items()}
_HF_TOP_MAP = {v: k for k, v in TOP_MAP.items()}

# Fields of ModelConfig that fix the tensors' shapes: an init_from folder must agree on all of them.
SHAPE_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "kv_heads", "head_dim", "ffn_dim", "tie_embeddings",
                "qkv_bias", "qk_norm")


class HFInteropError(ValueError):
    """A folder, config or state that cannot be mapped; the message says what and how to fix it."""


@dataclass(frozen=True)
class HFFamily:
    """One Hugging Face architecture: how our config and tensors become its folder and back."""

    name: str  # ModelConfig.family
    model_type: str  # config.json model_type
    architecture: str  # config.json architectures[0]
    extra_config: Callable[[ModelConfig], dict[str, Any]]  # its config.json fields beyond the shared ones
    read_config: Callable[[dict[str, Any]], dict[str, Any]]  # its ModelConfig fields; refuses what we cannot run
    to_hf_state: Callable[[dict[str, torch.Tensor], ModelConfig], dict[str, torch.Tensor]] | None = None
    from_hf_state: Callable[[dict[str, torch.Tensor], ModelConfig], dict[str, torch.Tensor]] | None = None


def to_hf_name(name: str) -> str:
    """`layers.3.attention.wq.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    name = canonical_name(name)
    if name in TOP_MAP:
        return TOP_MAP[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in LAYER_MAP:
        return f"model.layers.{m.group(1)}.{LAYER_MAP[m.group(2)]}"
    raise HFInteropError(f"parameter {name!r} has no Hugging Face equivalent")


def from_hf_name(name: str) -> str | None:
    """The inverse of `to_hf_name`; None for HF tensors we do not use (e.g. rotary caches)."""
    if name in _HF_TOP_MAP:
        return _HF_TOP_MAP[name]
    m = _HF_LAYER_RE.match(name)
    if m and m.group(2) in _HF_LAYER_MAP:
        return f"layers.{m.group(1)}.{_HF_LAYER_MAP[m.group(2)]}"
    return None


def dense_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return {to_hf_name(k): v for k, v in state.items()}


def dense_from_hf(hf_state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return {ours: t for name, t in hf_state.items() if (ours := from_hf_name(name)) is not None}


def decoder_config_dict(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The config.json fields every HF decoder of our shape shares (Llama, Mistral, Qwen, Mixtral)."""
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        # Both spellings: transformers 4.x reads rope_theta, 5.x reads rope_parameters.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
        "bos_token_id": None,
        "eos_token_id": None,
        "use_cache": True,
    }


def decoder_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Our ModelConfig fields from the config.json fields every family shares; refuses rotary scaling
    and activations our model does not reproduce."""
    if hf.get("hidden_act", "silu") != "silu":
        raise HFInteropError(f"config.json hidden_act={hf['hidden_act']!r}: our MLP is SwiGLU (silu)")
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise HFInteropError(f"config.json rope_type={rope_type!r}: only default rotary embeddings are supported")
    try:
        n_heads, dim = int(hf["num_attention_heads"]), int(hf["hidden_size"])
        return {
            "vocab_size": hf["vocab_size"],
            "dim": dim,
            "n_layers": hf["num_hidden_layers"],
            "n_heads": n_heads,
            "n_kv_heads": hf.get("num_key_value_heads") or n_heads,
            "head_dim": hf.get("head_dim") or dim // n_heads,
            "hidden_dim": hf["intermediate_size"],
            "norm_eps": hf.get("rms_norm_eps", 1e-6),
            "rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            "max_seq_len": hf.get("max_position_embeddings", 4096),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        }
    except KeyError as e:
        raise HFInteropError(f"config.json lacks {e.args[0]!r}; it is not a decoder model config") from None


def refuse_sliding_window(hf: dict[str, Any], family: str) -> None:
    """Our attention is full causal: a sliding window that ever takes effect cannot be reproduced."""
    types = hf.get("layer_types") or []
    window = hf.get("sliding_window")
    if "sliding_attention" in types or hf.get("use_sliding_window") or (
        family == "mistral" and window is not None and window < hf.get("max_position_embeddings", 0)
    ):
        raise HFInteropError(
            f"config.json of this {family} model uses sliding-window attention (sliding_window={window}); "
            "our attention is full causal, so its outputs would differ"
        )


def read_folder(path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, every tensor of the folder's safetensors files, by HF name)."""
    from safetensors.torch import load_file

    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise HFInteropError(f"{str(folder)!r} has no config.json: point at an export-hf or Hugging Face model folder")
    config = json.loads(config_file.read_text(encoding="utf-8"))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise HFInteropError(f"{str(folder)!r} has no model.safetensors: only safetensors weights are read")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(folder / f)))
    return config, tensors


def write_folder(out_dir: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    """model.safetensors + config.json (its dtype fields set from the tensors)."""
    from safetensors.torch import save_file

    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    out = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    dtypes = {t.dtype for t in out.values()}
    dtype_name = str(dtypes.pop() if len(dtypes) == 1 else torch.float32).removeprefix("torch.")
    config = {**config, "torch_dtype": dtype_name, "dtype": dtype_name}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return path


def expected_names(cfg: ModelConfig) -> set[str]:
    """Every parameter of the model (our naming); a tied head is the embedding, so it is not listed."""
    from parallel.model import build_model

    names = {canonical_name(n) for n, _ in build_model(cfg, device="meta").named_parameters()}
    if cfg.tie_embeddings:
        names.discard("output.weight")
    return names


def full_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical names, full (gathered) CPU tensors."""
    out = {}
    for k, t in state.items():
        if hasattr(t, "full_tensor"):  # a DTensor slipped through: gather it
            t = t.full_tensor()
        out[canonical_name(k)] = t.detach().to("cpu")
    return out


@torch.no_grad()
def copy_into(model: nn.Module, cfg: ModelConfig, state: dict[str, torch.Tensor], hf_cfg: ModelConfig,
              path: str) -> None:
    """Copy full tensors (our naming) into `model`, which may be sharded (DTensor) or a pipeline stage.

    Each rank reads the full tensors and keeps its own shard (`distribute_tensor` with
    `src_data_rank=None`, as `init_weights` does), so no communication is needed.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    diffs = [
        f"{f}: job has {getattr(cfg, f)}, checkpoint has {getattr(hf_cfg, f)}"
        for f in (*SHAPE_FIELDS, "family")
        if getattr(cfg, f) != getattr(hf_cfg, f)
    ]
    if cfg.moe is not None and hf_cfg.moe is not None and cfg.moe.num_experts != hf_cfg.moe.num_experts:
        diffs.append(f"moe.num_experts: job has {cfg.moe.num_experts}, checkpoint has {hf_cfg.moe.num_experts}")
    if diffs:
        raise HFInteropError(
            f"model.init_from={path!r} does not fit the job's model; set model.* to match:\n  " + "\n  ".join(diffs)
        )
    for name, p in model.named_parameters(remove_duplicate=True):
        canonical = canonical_name(name)
        if canonical == "output.weight" and cfg.tie_embeddings:
            canonical = "tok_embeddings.weight"  # a layout may list the tied head under its own name
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
