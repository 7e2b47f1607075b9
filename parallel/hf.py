"""Hugging Face interop: our Llama weights to and from a `LlamaForCausalLM` folder.

Our rotary embeddings use the "rotate half" convention, as HF Llama does, so every tensor
maps one-to-one by name with no permutation. The folder holds `config.json` and
`model.safetensors` (or HF's sharded `model-*.safetensors` + index), which
`transformers.AutoModelForCausalLM.from_pretrained` loads; transformers itself is not needed here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallel.config import ModelConfig
from parallel.model import canonical_name

# Our names -> HF names, per layer; the layer index is filled in.
_LAYER_MAP: dict[str, str] = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_MAP: dict[str, str] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_LAYER_MAP = {v: k for k, v in _LAYER_MAP.items()}
_HF_TOP_MAP = {v: k for k, v in _TOP_MAP.items()}


class HFInteropError(ValueError):
    """A folder, config or state that cannot be mapped; the message says what and how to fix it."""


def to_hf_name(name: str) -> str:
    """`layers.3.attention.wq.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    name = canonical_name(name)
    if name in _TOP_MAP:
        return _TOP_MAP[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_MAP:
        return f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}"
    raise HFInteropError(f"parameter {name!r} has no Hugging Face Llama equivalent (MoE models cannot be exported)")


def from_hf_name(name: str) -> str | None:
    """The inverse of `to_hf_name`; None for HF tensors we do not use (e.g. rotary caches)."""
    if name in _HF_TOP_MAP:
        return _HF_TOP_MAP[name]
    m = _HF_LAYER_RE.match(name)
    if m and m.group(2) in _HF_LAYER_MAP:
        return f"layers.{m.group(1)}.{_HF_LAYER_MAP[m.group(2)]}"
    return None


def decoder_config_dict(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The config.json fields every HF decoder of our shape shares (Llama and Mixtral)."""
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


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The `config.json` of a LlamaForCausalLM with our model's shape."""
    if cfg.moe is not None:
        raise HFInteropError("model.moe is set: only dense Llama models export to Hugging Face format")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **decoder_config_dict(cfg, dtype),
        "attention_bias": False,
        "mlp_bias": False,
    }


def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Our ModelConfig from a Llama `config.json`; refuses what our model cannot reproduce."""
    model_type = hf.get("model_type")
    if model_type not in ("llama", None):
        raise HFInteropError(f"config.json model_type={model_type!r}: only 'llama' models can be loaded")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise HFInteropError(f"config.json {flag}=true: our Llama has no biases")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFInteropError(f"config.json hidden_act={hf['hidden_act']!r}: our Llama uses silu (SwiGLU)")
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise HFInteropError(f"config.json rope_type={rope_type!r}: only default rotary embeddings are supported")
    rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    n_heads = hf["num_attention_heads"]
    dim = hf["hidden_size"]
    if hf.get("head_dim") not in (None, dim // n_heads):
        raise HFInteropError(
            f"config.json head_dim={hf['head_dim']} differs from hidden_size/num_attention_heads={dim // n_heads}"
        )
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        dim=dim,
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        hidden_dim=hf["intermediate_size"],
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        max_seq_len=hf.get("max_position_embeddings", 4096),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def export_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str) -> None:
    """Write `state` (full tensors in our naming) as a folder `from_pretrained` loads as LlamaForCausalLM
    (MixtralForCausalLM for the MoE family)."""
    from safetensors.torch import save_file

    if cfg.moe is not None:
        from parallel.hf_mixtral import export_mixtral  # lazy: it builds on this module

        export_mixtral(state, cfg, out_dir)
        return

    config = hf_config_dict(cfg)  # refuses what HF Llama cannot hold before anything is written
    state = {canonical_name(k): v for k, v in state.items()}
    expected = _expected_names(cfg)
    missing = sorted(expected - state.keys())
    if missing:
        raise HFInteropError(f"the state lacks {len(missing)} tensors of the model, e.g. {missing[:3]}")
    out: dict[str, torch.Tensor] = {}
    for name in sorted(expected):
        t = state[name]
        if hasattr(t, "full_tensor"):  # a DTensor slipped through: gather it
            t = t.full_tensor()
        out[to_hf_name(name)] = t.detach().to("cpu").contiguous().clone()
    if cfg.tie_embeddings and "output.weight" in state:
        head, emb = state["output.weight"], state["tok_embeddings.weight"]
        if head.shape != emb.shape or not torch.equal(head.detach().cpu(), emb.detach().cpu()):
            # HF would use the embedding as the head: exporting would silently change the model.
            raise HFInteropError(
                "model.tie_embeddings=true but output.weight differs from tok_embeddings.weight in the state; "
                "the weights were not tied during training, so they cannot be exported as a tied model"
            )
    dtypes = {t.dtype for t in out.values()}
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    dtype_name = str(dtypes.pop() if len(dtypes) == 1 else torch.float32).removeprefix("torch.")
    config.update(torch_dtype=dtype_name, dtype=dtype_name)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def load_hf_state_dict(path: str) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """Read an HF Llama folder into (full tensors in our naming, our ModelConfig)."""
    from safetensors.torch import load_file

    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise HFInteropError(f"{str(folder)!r} has no config.json: point at an export-hf or Hugging Face model folder")
    cfg = model_config_from_hf(json.loads(config_file.read_text(encoding="utf-8")))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise HFInteropError(f"{str(folder)!r} has no model.safetensors: only safetensors weights are read")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        for hf_name, t in load_file(str(folder / f)).items():
            ours = from_hf_name(hf_name)
            if ours is not None:
                state[ours] = t
    if cfg.tie_embeddings:
        state.pop("output.weight", None)  # the tied head is the embedding
    missing = sorted(_expected_names(cfg) - state.keys())
    if missing:
        raise HFInteropError(f"{str(folder)!r} lacks {len(missing)} tensors, e.g. {[to_hf_name(m) for m in missing[:3]]}")
    return state, cfg


_SHAPE_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "kv_heads", "ffn_dim", "tie_embeddings")


@torch.no_grad()
def load_hf_weights(model: nn.Module, cfg: ModelConfig, path: str) -> None:
    """Copy an HF folder's weights into `model`, which may be sharded (DTensor) or a pipeline stage.

    Each rank reads the full tensors and keeps its own shard (`distribute_tensor` with
    `src_data_rank=None`, as `init_weights` does), so no communication is needed.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    state, hf_cfg = load_hf_state_dict(path)
    diffs = [
        f"{f}: job has {getattr(cfg, f)}, checkpoint has {getattr(hf_cfg, f)}"
        for f in _SHAPE_FIELDS
        if getattr(cfg, f) != getattr(hf_cfg, f)
    ]
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


def _expected_names(cfg: ModelConfig) -> set[str]:
    names = {"tok_embeddings.weight", "norm.weight"}
    if not cfg.tie_embeddings:
        names.add("output.weight")
    for i in range(cfg.n_layers):
        names.update(f"layers.{i}.{k}" for k in _LAYER_MAP)
    return names
