"""The Llama and Mistral families: `LlamaForCausalLM` and `MistralForCausalLM` folders.

Both are our dense decoder as is (no biases, no q/k norms). Mistral differs only by name and by
its sliding-window attention, which we run only where it never takes effect (sliding_window null
or at least the context length); a folder that would slide is refused.
"""

from __future__ import annotations

from typing import Any

from parallel.config import ModelConfig
from parallel.hf_common import HFFamily, HFInteropError, refuse_sliding_window


def _llama_config(cfg: ModelConfig) -> dict[str, Any]:
    return {"attention_bias": False, "mlp_bias": False}


def _read_llama(hf: dict[str, Any]) -> dict[str, Any]:
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise HFInteropError(f"config.json {flag}=true: our Llama has no biases")
    return {}


def _mistral_config(cfg: ModelConfig) -> dict[str, Any]:
    return {"sliding_window": None, "attention_dropout": 0.0}


def _read_mistral(hf: dict[str, Any]) -> dict[str, Any]:
    refuse_sliding_window(hf, "mistral")
    return {}


LLAMA = HFFamily("llama", "llama", "LlamaForCausalLM", _llama_config, _read_llama)
MISTRAL = HFFamily("mistral", "mistral", "MistralForCausalLM", _mistral_config, _read_mistral)
