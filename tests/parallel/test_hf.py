"""Hugging Face interop: our model and transformers' LlamaForCausalLM agree on logits, and weights round-trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from parallel.config import ModelConfig
from parallel.hf import HFInteropError, export_hf, load_hf_state_dict, load_hf_weights
from parallel.model import build_model, init_weights

transformers = pytest.importorskip("transformers")

CONFIGS = {
    # multi-head attention, tied embeddings
    "tiny-mha-tied": ModelConfig(preset="tiny", n_kv_heads=None, tie_embeddings=True, max_seq_len=64),
    # grouped-query attention (8 heads share 2 kv heads), odd rope theta and eps, explicit MLP width
    "gqa": ModelConfig(
        vocab_size=300, dim=96, n_layers=3, n_heads=8, n_kv_heads=2, hidden_dim=200,
        rope_theta=500000.0, norm_eps=1e-6, max_seq_len=128, init_seed=7,
    ),
}


def _our_model(cfg: ModelConfig) -> torch.nn.Module:
    model = build_model(cfg, device="cpu")  # on cpu, not meta: to_empty would untie tied embeddings
    init_weights(model, cfg)
    return model.eval()


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(name: str, tmp_path: Path) -> None:
    cfg = CONFIGS[name]
    ours = _our_model(cfg)
    export_hf(_state(ours), cfg, str(tmp_path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert hf.config.tie_word_embeddings == cfg.tie_embeddings
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = ours(tokens)
        b = hf(input_ids=tokens).logits
    assert a.shape == b.shape
    assert (a - b).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_export_then_load_is_identity(name: str, tmp_path: Path) -> None:
    cfg = CONFIGS[name]
    src = _our_model(cfg)
    export_hf(_state(src), cfg, str(tmp_path))
    state, loaded_cfg = load_hf_state_dict(str(tmp_path))
    for field in ("vocab_size", "dim", "n_layers", "n_heads", "kv_heads", "ffn_dim", "tie_embeddings",
                  "rope_theta", "norm_eps", "max_seq_len"):
        assert getattr(loaded_cfg, field) == getattr(cfg, field), field
    dst = build_model(cfg, device="cpu")  # default nn init: different from src
    load_hf_weights(dst, cfg, str(tmp_path))
    for (n, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items(), strict=True):
        assert torch.equal(a, b), n


def test_load_into_sharded_model(tmp_path: Path) -> None:
    """The DTensor path: FSDP2 shards at world 1 (a real gloo group in this process)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    cfg = CONFIGS["gqa"]
    src = _our_model(cfg)
    export_hf(_state(src), cfg, str(tmp_path / "hf"))
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
        model = build_model(cfg, device="meta")
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        assert any(isinstance(p, DTensor) for p in model.parameters())
        load_hf_weights(model, cfg, str(tmp_path / "hf"))
        got = {n: p.full_tensor() for n, p in model.named_parameters()}
        for n, p in src.named_parameters():
            assert torch.equal(got[n], p), n
    finally:
        dist.destroy_process_group()


def test_mismatched_and_bad_folders_are_refused(tmp_path: Path) -> None:
    cfg = CONFIGS["gqa"]
    export_hf(_state(_our_model(cfg)), cfg, str(tmp_path / "hf"))
    other = ModelConfig(preset="tiny")
    with pytest.raises(HFInteropError, match=r"dim: job has 64, checkpoint has 96"):
        load_hf_weights(build_model(other, device="cpu"), other, str(tmp_path / "hf"))
    with pytest.raises(HFInteropError, match="no config.json"):
        load_hf_state_dict(str(tmp_path / "missing"))
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    conf["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 1.0}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(conf))
    with pytest.raises(HFInteropError, match="rope_type='llama3'"):
        load_hf_state_dict(str(tmp_path / "hf"))
    # MoE models export as Mixtral; one Mixtral cannot express is refused, naming the field.
    moe = ModelConfig(preset="mixtral-tiny", moe={"num_experts": 4, "top_k": 2, "every_n_layers": 2})
    with pytest.raises(HFInteropError, match="every_n_layers"):
        export_hf({}, moe, str(tmp_path / "moe"))


def test_untied_state_for_a_tied_config_is_refused(tmp_path: Path) -> None:
    cfg = CONFIGS["tiny-mha-tied"]
    state = _state(_our_model(cfg))
    state["output.weight"] = state["tok_embeddings.weight"] + 1.0
    with pytest.raises(HFInteropError, match="not tied during training"):
        export_hf(state, cfg, str(tmp_path))
