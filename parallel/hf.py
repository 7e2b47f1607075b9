"""Hugging Face interop: our models to and from `*ForCausalLM` folders of every family we run.

Families: Llama and Mistral (parallel.hf_llama), Qwen2/2.5 and Qwen3 (parallel.hf_qwen), Mixtral
(parallel.hf_mixtral); what they share lives in parallel.hf_common. `ModelConfig.family` picks the
one a model exports as; a folder's config.json `model_type` picks the one it is read with. The
folder holds `config.json` and `model.safetensors` (or HF's sharded files + index), which
`transformers.AutoModelForCausalLM.from_pretrained` loads; transformers itself is not needed here.
With a tokenizer, its files travel with the export (and config.json names its EOS/BOS ids), so
`AutoTokenizer` and `AutoModelForCausalLM` on the folder generate text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallel.config import ModelConfig
from parallel.hf_common import (
    HFFamily,
    HFInteropError,
    copy_into,
    decoder_config_dict,
    decoder_fields,
    dense_from_hf,
    dense_to_hf,
    expected_names,
    from_hf_name,
    full_state,
    read_folder,
    to_hf_name,
    write_folder,
)
from parallel.hf_llama import LLAMA, MISTRAL
from parallel.hf_mixtral import MIXTRAL
from parallel.hf_qwen import QWEN2, QWEN3

__all__ = [
    "FAMILIES", "HFInteropError", "export_hf", "from_hf_name", "hf_config_dict", "load_hf_state_dict",
    "load_hf_weights", "model_config_from_hf", "to_hf_name",
]

FAMILIES: dict[str, HFFamily] = {f.name: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3, MIXTRAL)}
_BY_MODEL_TYPE: dict[str, HFFamily] = {f.model_type: f for f in FAMILIES.values()}


def _family(cfg: ModelConfig) -> HFFamily:
    assert cfg.family is not None  # resolved by ModelConfig's validation
    return FAMILIES[cfg.family]


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The `config.json` of our model's family (LlamaForCausalLM, Qwen2ForCausalLM, ...) with its shape."""
    fam = _family(cfg)
    return {"architectures": [fam.architecture], "model_type": fam.model_type, **decoder_config_dict(cfg, dtype),
            **fam.extra_config(cfg)}


def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Our ModelConfig from a `config.json` of any supported family; refuses what our model cannot reproduce."""
    model_type = hf.get("model_type") or "llama"
    fam = _BY_MODEL_TYPE.get(model_type)
    if fam is None:
        raise HFInteropError(f"config.json model_type={model_type!r}: only {sorted(_BY_MODEL_TYPE)} models can be "
                             "loaded")
    return ModelConfig(**decoder_fields(hf), **fam.read_config(hf), family=fam.name)


def export_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str, tokenizer: str | None = None) -> None:
    """Write `state` (full tensors in our naming) as a folder `from_pretrained` loads as the model's
    family, with the tokenizer at `tokenizer` (a tokenizer.json or a folder holding one) beside it."""
    fam = _family(cfg)
    config = hf_config_dict(cfg)  # refuses what the family cannot hold before anything is written
    state = full_state(state)
    expected = expected_names(cfg)
    missing = sorted(expected - state.keys())
    if missing:
        raise HFInteropError(f"the state lacks {len(missing)} tensors of the model, e.g. {missing[:3]}")
    if cfg.tie_embeddings and "output.weight" in state:
        head, emb = state["output.weight"], state["tok_embeddings.weight"]
        if head.shape != emb.shape or not torch.equal(head, emb):
            # HF would use the embedding as the head: exporting would silently change the model.
            raise HFInteropError(
                "model.tie_embeddings=true but output.weight differs from tok_embeddings.weight in the state; "
                "the weights were not tied during training, so they cannot be exported as a tied model"
            )
    to_hf = fam.to_hf_state or dense_to_hf
    tensors = to_hf({k: state[k] for k in sorted(expected)}, cfg)
    tok = None
    if tokenizer is not None:
        from parallel.data.tokenizer import load_tokenizer

        tok = load_tokenizer(tokenizer, field="tokenizer")
        if tok.vocab_size > cfg.vocab_size:
            raise HFInteropError(f"the tokenizer {tok.name} has {tok.vocab_size} ids but model.vocab_size="
                                 f"{cfg.vocab_size}: it is not this model's tokenizer")
        bos = tok.token_id(tok.bos_token) if tok.bos_token else None
        config.update(eos_token_id=tok.eos_id, bos_token_id=bos)
    path = write_folder(out_dir, tensors, config)
    if tok is not None:
        from parallel.data.tokenizer import save_tokenizer

        save_tokenizer(tok, path)
        gen = {"eos_token_id": tok.eos_id, "bos_token_id": config["bos_token_id"], "pad_token_id": tok.eos_id}
        (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")


def load_hf_state_dict(path: str) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """Read a folder of any supported family into (full tensors in our naming, our ModelConfig)."""
    config, tensors = read_folder(path)
    cfg = model_config_from_hf(config)
    from_hf = _family(cfg).from_hf_state or dense_from_hf
    state = from_hf(tensors, cfg)
    if cfg.tie_embeddings:
        state.pop("output.weight", None)  # the tied head is the embedding
    missing = sorted(expected_names(cfg) - state.keys())
    if missing:
        raise HFInteropError(f"{str(Path(path))!r} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return state, cfg


@torch.no_grad()
def load_hf_weights(model: nn.Module, cfg: ModelConfig, path: str) -> None:
    """Copy a folder's weights into `model`, which may be sharded (DTensor), expert-parallel or a
    pipeline stage; every rank reads the full tensors and keeps its shard, with no communication."""
    state, hf_cfg = load_hf_state_dict(path)
    copy_into(model, cfg, state, hf_cfg, path)
