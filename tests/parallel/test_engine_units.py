"""Single-process units of the engine: parameter and FLOP counts, MFU, the LR schedule,
gradient clipping, ZeRO stage mapping, and the Trainer's metrics and errors."""

from __future__ import annotations

import math

import pytest
import torch

from parallel.config import EngineConfig, ModelConfig, TrainConfig
from parallel.layout_rules import ParallelDimsError
from parallel.metrics import device_peak_flops, flops_per_token, mfu, param_counts, peak_memory_bytes
from parallel.model import build_model
from parallel.optim import clip_grad_norm_, lr_factor
from parallel.trainer import Trainer


@pytest.mark.parametrize(
    "model",
    [dict(preset="tiny"), dict(preset="debug"), dict(preset="tiny", tie_embeddings=True),
     dict(preset="tiny", hidden_dim=100), dict(preset="mixtral-tiny")],
)
def test_param_counts_match_the_model(model: dict) -> None:
    cfg = ModelConfig(**model)
    counts = param_counts(cfg)
    assert counts["total"] == build_model(cfg).num_params()
    assert counts["embedding"] == cfg.vocab_size * cfg.dim


def test_flops_per_token_is_torchtitans_formula() -> None:
    cfg = ModelConfig(preset="debug")
    n = build_model(cfg).num_params(exclude_embedding=True)
    assert flops_per_token(cfg, 128) == 6 * n + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * 128


def test_moe_counts_only_active_experts() -> None:
    cfg = ModelConfig(preset="mixtral-tiny")
    counts = param_counts(cfg)
    expert = 3 * cfg.dim * cfg.ffn_dim
    assert counts["total"] - counts["embedding"] - counts["active_non_embedding"] == (
        cfg.n_layers * (cfg.moe.num_experts - cfg.moe.top_k) * expert
    )


def test_mfu_needs_a_known_peak() -> None:
    assert device_peak_flops(torch.device("cpu"), "bfloat16") is None
    assert mfu(1000.0, 1e6, None, 4) is None
    assert mfu(1000.0, 1e9, 1e12, 2) == pytest.approx(0.5)
    assert peak_memory_bytes(torch.device("cpu")) > 10 * 2**20


def test_lr_schedule_warmup_then_cosine() -> None:
    t = TrainConfig(steps=10, warmup_steps=2, min_lr_ratio=0.1)
    factors = [lr_factor(s, t) for s in range(10)]
    assert factors[:2] == [0.5, 1.0]
    assert factors[2] == 1.0
    assert all(a > b for a, b in zip(factors[2:], factors[3:], strict=False))
    assert lr_factor(10, t) == pytest.approx(0.1)
    assert factors[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


@pytest.mark.parametrize("max_norm", [None, 0.5, 1e6])
def test_clip_matches_torch(max_norm: float | None) -> None:
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for pa, pb in zip(a, b, strict=True):
        g = torch.randn_like(pa)
        pa.grad, pb.grad = g.clone(), g.clone()
    norm = clip_grad_norm_(a, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(b, max_norm if max_norm is not None else float("inf"))
    assert norm == pytest.approx(float(expected), rel=1e-6)
    for pa, pb in zip(a, b, strict=True):
        torch.testing.assert_close(pa.grad, pb.grad)


def tiny_cfg(**training: object) -> EngineConfig:
    return EngineConfig.model_validate({
        "model": {"preset": "tiny"},
        "training": {"steps": 4, "seq_len": 16, "global_batch_size": 4, **training},
    })


def test_step_metrics() -> None:
    trainer = Trainer(tiny_cfg(), device=torch.device("cpu"))
    m = trainer.train_step()
    assert (m.step, m.tokens, m.dp, m.world_size) == (1, 4 * 16, 1, 1)
    assert trainer.step == 1
    assert 4.0 < m.loss < 8.0 and m.grad_norm > 0 and m.step_time_s > 0
    assert m.tokens_per_s == pytest.approx(m.tokens / m.step_time_s)
    assert m.lr == pytest.approx(3e-4 * 0.5)  # warmup step 0 of 2
    assert m.mfu is None and m.peak_mem_bytes > 0


@pytest.mark.parametrize("tie", [False, True])
def test_a_trainer_built_to_be_restored_draws_no_weights_and_matches_once_loaded(tie: bool) -> None:
    """restoring=True (a re-form) skips the weights' values, not the rest: the RoPE tables, the tied output."""
    cfg = tiny_cfg()
    cfg.model.tie_embeddings = tie
    ref = Trainer(cfg, device=torch.device("cpu"))
    ref.train_step()
    built = Trainer(cfg, device=torch.device("cpu"), restoring=True)
    assert torch.equal(built.model.rope_cos, ref.model.rope_cos) and torch.equal(built.model.rope_sin, ref.model.rope_sin)
    assert (built.model.output.weight is built.model.tok_embeddings.weight) == tie
    built.load_state_dict(ref.state_dict())
    assert built.step == ref.step == 1
    assert built.train_step().loss == ref.train_step().loss


def test_micro_batches_do_not_change_the_step() -> None:
    whole = Trainer(tiny_cfg(), device=torch.device("cpu"))
    split = Trainer(tiny_cfg(micro_batch_size=1), device=torch.device("cpu"))
    for _ in range(3):
        assert whole.train_step().loss == pytest.approx(split.train_step().loss, abs=1e-6)


def test_trainer_refuses_bad_layouts() -> None:
    cfg = tiny_cfg(global_batch_size=1)
    cfg.parallelism.tp = 3
    with pytest.raises(ParallelDimsError, match=r"dp_replicate\*cp\*tp\*pp=3 does not divide world_size=1"):
        Trainer(cfg, device=torch.device("cpu"))


def test_backend_follows_the_device() -> None:
    from parallel import dist as pdist

    assert pdist.backend_for("cpu") == "gloo" and pdist.backend_for(torch.device("cuda", 0)) == "nccl"
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert pdist.default_device().type == expected


def test_group_of_one_forms_trains_and_leaves_twice() -> None:
    """Re-forming in the same process: a group, destroyed, then a new group on a new store port."""
    import torch.distributed as dist

    from parallel import dist as pdist

    losses = []
    for _ in range(2):
        store = pdist.make_store("127.0.0.1", 0, 1, is_master=True)
        pdist.init_process_group(0, 1, store, device="cpu", timeout_s=30)
        try:
            assert dist.get_backend() == "gloo" and pdist.world_size() == 1
            with pytest.raises(RuntimeError, match="already initialised"):
                pdist.init_process_group(0, 1, store, device="cpu")
            trainer = Trainer(tiny_cfg(), device=torch.device("cpu"))
            assert trainer.mesh is None
            losses.append(trainer.train_step().loss)
        finally:
            pdist.destroy_process_group()
        pdist.destroy_process_group()  # twice is harmless
    assert losses[0] == losses[1]
