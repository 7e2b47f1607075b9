"""MoE models to and from Hugging Face Mixtral folders: logits against transformers, round trip, refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parallel.config import ModelConfig
from parallel.hf import HFInteropError, export_hf
from parallel.hf_mixtral import (
    load_mixtral_state_dict,
    load_mixtral_weights,
    mixtral_config_dict,
)
from parallel.model import build_model, init_weights


def _cfg() -> ModelConfig:
    return ModelConfig(preset="mixtral-tiny", moe={"num_experts": 4, "top_k": 2, "aux_loss_coef": 0.02}, init_seed=3)


def _model(cfg: ModelConfig) -> torch.nn.Module:
    model = build_model(cfg)
    init_weights(model, cfg, device="cpu")
    return model.eval()


def test_export_loads_in_transformers_with_the_same_logits(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = _cfg()
    ours = _model(cfg)
    export_hf(ours.state_dict(), cfg, str(tmp_path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32).eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=1e-5, rtol=1e-4)


def test_round_trip_and_load_into_a_model(tmp_path: Path) -> None:
    cfg = _cfg()
    src = _model(cfg)
    export_hf(src.state_dict(), cfg, str(tmp_path))
    state, got_cfg = load_mixtral_state_dict(str(tmp_path))
    assert got_cfg.moe is not None and got_cfg.moe.num_experts == 4 and got_cfg.moe.aux_loss_coef == 0.02
    for name, t in src.state_dict().items():
        assert torch.equal(state[name], t), name
    dst = build_model(cfg)
    init_weights(dst, cfg, seed=99, device="cpu")
    load_mixtral_weights(dst, cfg, str(tmp_path))
    for (name, a), b in zip(src.state_dict().items(), dst.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_unexportable_models_are_refused(tmp_path: Path) -> None:
    with pytest.raises(HFInteropError, match="every_n_layers=2"):
        mixtral_config_dict(ModelConfig(preset="mixtral-tiny", moe={"every_n_layers": 2}))
    with pytest.raises(HFInteropError, match="model.moe is not set"):
        mixtral_config_dict(ModelConfig(preset="tiny"))
    cfg = _cfg()
    export_hf(_model(cfg).state_dict(), cfg, str(tmp_path))
    other = ModelConfig(preset="mixtral-tiny", moe={"num_experts": 2, "top_k": 2})
    with pytest.raises(HFInteropError, match="moe.num_experts: job has 2, checkpoint has 4"):
        load_mixtral_weights(build_model(other, device="cpu"), other, str(tmp_path))
