"""The Qwen families: `Qwen2ForCausalLM` (Qwen2 and Qwen2.5: biases on q/k/v) and `Qwen3ForCausalLM`
(an RMSNorm of each q/k head before the rotary embedding, and a head_dim of its own).

Sliding-window layers (use_sliding_window) are refused: our attention is full causal. So is Qwen3's
attention_bias, which also puts a bias on the output projection, where our model has none.
"""

from __future__ import annotations

from typing import Any

from parallel.config import ModelConfig
from parallel.hf_common import HFFamily, HFInteropError, refuse_sliding_window


def _qwen_config(cfg: ModelConfig) -> dict[str, Any]:
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layers,
            "attention_dropout": 0.0}


def _read_qwen2(hf: dict[str, Any]) -> dict[str, Any]:
    refuse_sliding_window(hf, "qwen2")
    return {}


def _qwen3_config(cfg: ModelConfig) -> dict[str, Any]:
    return {**_qwen_config(cfg), "attention_bias": False}


def _read_qwen3(hf: dict[str, Any]) -> dict[str, Any]:
    refuse_sliding_window(hf, "qwen3")
    if hf.get("attention_bias"):
        raise HFInteropError("config.json attention_bias=true: Qwen3 then has an output-projection bias, "
                             "which our model lacks")
    return {}


QWEN2 = HFFamily("qwen2", "qwen2", "Qwen2ForCausalLM", _qwen_config, _read_qwen2)
QWEN3 = HFFamily("qwen3", "qwen3", "Qwen3ForCausalLM", _qwen3_config, _read_qwen3)
