"""Qwen2, Qwen3 and Mistral: logits equal to transformers' (random configs built here, fp32), round trips,
refusals, training from such a folder on tensor/context-parallel layouts, and an export that carries the
tokenizer so AutoTokenizer + AutoModelForCausalLM on the folder generate text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from parallel.config import ModelConfig
from parallel.hf import HFInteropError, export_hf, load_hf_state_dict, load_hf_weights
from parallel.model import build_model, init_weights

transformers = pytest.importorskip("transformers")

BASE: dict[str, Any] = dict(vocab_size=300, dim=96, n_layers=3, n_heads=6, n_kv_heads=2, hidden_dim=160,
                            rope_theta=1000000.0, norm_eps=1e-6, max_seq_len=128, init_seed=3)
CONFIGS = {
    "qwen2": (ModelConfig(family="qwen2", tie_embeddings=True, **BASE), "Qwen2ForCausalLM"),
    # Qwen3 with a head width of its own (96 / 6 = 16, but 24 here).
    "qwen3": (ModelConfig(family="qwen3", head_dim=24, **BASE), "Qwen3ForCausalLM"),
    "mistral": (ModelConfig(family="mistral", head_dim=32, **BASE), "MistralForCausalLM"),
}


def _model(cfg: ModelConfig) -> torch.nn.Module:
    """Our model with every tensor random (biases and norm weights too), so a misplaced one shows."""
    model = build_model(cfg, device="cpu")
    init_weights(model, cfg)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen) if name.endswith("weight")
                        else 0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_logits_match_transformers(family: str, tmp_path: Path) -> None:
    cfg, arch = CONFIGS[family]
    ours = _model(cfg)
    export_hf(_state(ours), cfg, str(tmp_path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert type(hf).__name__ == arch
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        err = (ours(tokens) - hf(input_ids=tokens).logits).abs().max().item()
    assert err <= 1e-5, f"{family}: logits differ by {err:.2e}"


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_round_trip_keeps_family_and_tensors(family: str, tmp_path: Path) -> None:
    cfg, _ = CONFIGS[family]
    src = _model(cfg)
    export_hf(_state(src), cfg, str(tmp_path))
    state, got = load_hf_state_dict(str(tmp_path))
    for field in ("family", "qkv_bias", "qk_norm", "head_dim", "vocab_size", "dim", "n_layers", "n_heads", "kv_heads",
                  "ffn_dim", "tie_embeddings", "rope_theta", "norm_eps", "max_seq_len"):
        assert getattr(got, field) == getattr(cfg, field), field
    dst = build_model(cfg, device="cpu")
    load_hf_weights(dst, cfg, str(tmp_path))
    for (n, a), b in zip(src.state_dict().items(), dst.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    # A job whose model section names another family is told which field to set.
    other = ModelConfig(**{**BASE, "head_dim": cfg.head_dim, "tie_embeddings": cfg.tie_embeddings})
    with pytest.raises(HFInteropError, match=f"family: job has llama, checkpoint has {family}"):
        load_hf_weights(build_model(other, device="cpu"), other, str(tmp_path))


def _edit(folder: Path, **changes: Any) -> None:
    conf = json.loads((folder / "config.json").read_text())
    conf.update(changes)
    (folder / "config.json").write_text(json.dumps(conf))


def test_what_our_model_cannot_run_is_refused(tmp_path: Path) -> None:
    for family in CONFIGS:
        cfg, _ = CONFIGS[family]
        export_hf(_state(_model(cfg)), cfg, str(tmp_path / family))
    _edit(tmp_path / "mistral", sliding_window=64)
    with pytest.raises(HFInteropError, match="sliding-window attention .sliding_window=64."):
        load_hf_state_dict(str(tmp_path / "mistral"))
    _edit(tmp_path / "qwen2", use_sliding_window=True, sliding_window=32)
    with pytest.raises(HFInteropError, match="sliding-window"):
        load_hf_state_dict(str(tmp_path / "qwen2"))
    _edit(tmp_path / "qwen3", attention_bias=True)
    with pytest.raises(HFInteropError, match="output-projection bias"):
        load_hf_state_dict(str(tmp_path / "qwen3"))
    _edit(tmp_path / "qwen3", attention_bias=False, model_type="gemma")
    with pytest.raises(HFInteropError, match="model_type='gemma': only .* models can be loaded"):
        load_hf_state_dict(str(tmp_path / "qwen3"))
    with pytest.raises(ValueError, match="qkv_bias=False but the qwen2 family has qkv_bias=True"):
        ModelConfig(family="qwen2", qkv_bias=False)


def test_export_carries_the_tokenizer_and_generates(tmp_path: Path) -> None:
    from parallel.data.tokenizer import load_tokenizer
    from tests.data.local_tokenizer import make_tokenizer

    tok_dir = make_tokenizer(tmp_path / "tok", vocab_size=300)
    cfg, _ = CONFIGS["qwen2"]
    export_hf(_state(_model(cfg)), cfg, str(tmp_path / "hf"), tokenizer=str(tok_dir))
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    ours = load_tokenizer(str(tok_dir))
    prompt = "def main():\n    return"
    ids = tok(prompt, return_tensors="pt").input_ids
    assert ids[0].tolist() == ours.encode_batch([prompt])[0]
    assert tok.eos_token == "<|endoftext|>" and model.config.eos_token_id == ours.eos_id
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    text = tok.decode(out[0])
    assert text.startswith(prompt) and isinstance(text, str)
    with pytest.raises(HFInteropError, match="has 512 ids but model.vocab_size=300"):
        export_hf(_state(_model(cfg)), cfg, str(tmp_path / "hf2"), tokenizer=str(make_tokenizer(tmp_path / "t2")))


TRAIN: dict[str, Any] = {"steps": 10, "seq_len": 32, "global_batch_size": 8, "warmup_steps": 2, "lr": 1e-3}
FAMILY_LAYOUTS: list[dict[str, Any]] = [
    dict(name="tp2", world=4, parallelism={"tp": 2}),
    dict(name="cp2", world=4, parallelism={"cp": 2}),
    dict(name="pp2", world=4, parallelism={"pp": 2, "pp_microbatches": 2}),
]


def _family_base(family: str, folder: Path) -> dict[str, Any]:
    """A small model of `family` started from a random folder of that family (init_from)."""
    shape: dict[str, Any] = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=96,
                                 family=family)
    if family == "qwen3":
        shape["head_dim"] = 24  # not dim / n_heads
    cfg = ModelConfig(**shape)
    export_hf(_state(_model(cfg)), cfg, str(folder))
    return {"model": {**shape, "init_from": str(folder)}, "training": TRAIN}


def test_qwen_models_train_alike_on_tp_cp_and_pp(tmp_path: Path) -> None:
    """Qwen3's per-head q/k norms (replicated weights over tp heads) and Qwen2's q/k/v biases (split with
    their projections): loaded by init_from on each layout, every layout matches one process."""
    from tests.parallel.layout_parity import check_parity, reference, run_many

    bases = {f: _family_base(f, tmp_path / f) for f in ("qwen2", "qwen3")}
    runs = [(bases[f], [{**lay, "name": f"{f}-{lay['name']}"} for lay in FAMILY_LAYOUTS]) for f in bases]
    got = run_many(runs, 4, timeout_s=600)
    for family, base in bases.items():
        ref = reference(base)
        for lay in FAMILY_LAYOUTS:
            check_parity(got[f"{family}-{lay['name']}"], ref, f"{family}-{lay['name']}")
