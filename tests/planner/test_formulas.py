"""The planner's arithmetic against published figures (ZeRO, Korthikanti et al., torchtitan, Mixtral)."""

from __future__ import annotations

import pytest

from parallel.config import ModelConfig
from parallel.planner.comm import all_gather_volume, all_reduce_volume, reduce_scatter_volume
from parallel.planner.flops import flops_per_token
from parallel.planner.memory import korthikanti_layer_bytes, model_state_bytes
from parallel.planner.params import count_params
from parallel.planner.timing import bubble_fraction

GB = 1e9


def test_mixed_precision_adamw_is_16_bytes_per_param_70b() -> None:
    psi = count_params(ModelConfig(preset="llama3-70b")).total
    assert psi == pytest.approx(70.55e9, rel=1e-3)
    w, g, o = model_state_bytes(psi, n=1, stage=0, dtype="bfloat16")
    assert (w, g, o) == (2 * psi, 2 * psi, 12 * psi)
    assert (w + g + o) / GB == pytest.approx(1129, rel=1e-3)  # "~1.1 TB for 70B"
    assert o / GB == pytest.approx(840, rel=0.01)  # optimizer part, 12 bytes/param, "~840 GB"


def test_fp32_adamw_is_16_bytes_per_param() -> None:
    w, g, o = model_state_bytes(1000, n=1, stage=0, dtype="float32")
    assert (w, g, o) == (4000, 4000, 8000)


@pytest.mark.parametrize(
    ("stage", "expected_gb"),
    # ZeRO paper, Figure 1: Ψ = 7.5B, N = 64, K = 12.
    [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)],
)
def test_zero_paper_per_device_model_states(stage: int, expected_gb: float) -> None:
    psi, n = 7.5e9, 64
    total = sum(model_state_bytes(psi, n, stage, "bfloat16"))
    assert total / GB == pytest.approx(expected_gb, abs=0.06)
    formula = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]
    assert total == pytest.approx(formula)


def test_llama3_8b_flops_per_token_matches_torchtitan() -> None:
    cfg = ModelConfig(preset="llama3-8b")
    pc = count_params(cfg)
    assert pc.total == 8_030_261_248  # Llama 3 8B's published parameter count
    assert pc.flops_params == pc.total - 128256 * 4096  # N excludes the input embedding
    assert flops_per_token(cfg, 8192) == pytest.approx(5.79e10, rel=1e-3)


def test_flops_match_the_engines_mfu_definition() -> None:
    from parallel.metrics import flops_per_token as engine_flops  # imports torch; the engine's own count

    for preset in ("tiny", "small", "llama3-1b", "llama3-8b", "mixtral-tiny", "mixtral-8x7b"):
        cfg = ModelConfig(preset=preset)
        assert flops_per_token(cfg, 2048) == engine_flops(cfg, 2048), preset


def test_mixtral_8x7b_total_and_active_params() -> None:
    pc = count_params(ModelConfig(preset="mixtral-8x7b"))
    assert pc.total / 1e9 == pytest.approx(46.7, abs=0.05)  # Mistral's published figures
    assert pc.active / 1e9 == pytest.approx(12.9, abs=0.05)


def test_param_counts_match_the_built_model() -> None:
    from parallel.model import build_model

    for preset in ("tiny", "small", "llama3-1b", "mixtral-tiny"):
        cfg = ModelConfig(preset=preset)
        assert count_params(cfg).total == build_model(cfg, "meta").num_params(), preset


def test_korthikanti_table2() -> None:
    s, b, h, a, t = 2048, 1, 12288, 96, 8  # GPT-3 175B
    sbh = s * b * h
    assert korthikanti_layer_bytes(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    assert korthikanti_layer_bytes(s, b, h, a, t, sp=False) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert korthikanti_layer_bytes(s, b, h, a, t, sp=True) == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    assert korthikanti_layer_bytes(s, b, h, a, t, sp=True, recompute="selective") == pytest.approx(sbh * 34 / t)
    assert korthikanti_layer_bytes(s, b, h, a, t, sp=True, recompute="full") == pytest.approx(2 * sbh / t)
    # The paper: selective recomputation + SP keeps ~30% of the activations (5as/h = 80 for GPT-3).
    ratio = korthikanti_layer_bytes(s, b, h, a, t, recompute="selective") / korthikanti_layer_bytes(s, b, h, a, t)
    assert ratio == pytest.approx(34 / 114)


@pytest.mark.parametrize(
    ("schedule", "p", "m", "v", "expected"),
    [("1f1b", 4, 8, 1, 3 / 8), ("gpipe", 4, 8, 1, 3 / 8), ("interleaved_1f1b", 4, 8, 2, 3 / 16),
     ("zero_bubble", 4, 8, 2, 3 / 48), ("1f1b", 1, 8, 1, 0.0)],
)
def test_bubble_fractions(schedule: str, p: int, m: int, v: int, expected: float) -> None:
    assert bubble_fraction(schedule, p, m, v) == pytest.approx(expected)


def test_collective_volumes() -> None:
    assert all_reduce_volume(100, 4) == pytest.approx(150)  # 2(n-1)/n·S
    assert all_gather_volume(100, 4) == pytest.approx(75)  # (n-1)/n·S
    assert reduce_scatter_volume(100, 4) == pytest.approx(75)
    assert all_reduce_volume(100, 1) == 0.0
    # FSDP moves 3Ψ a step (gather fwd + gather bwd + reduce-scatter) against DDP's 2Ψ.
    psi = 1e9
    fsdp = 2 * all_gather_volume(psi, 8) + reduce_scatter_volume(psi, 8)
    assert fsdp / all_reduce_volume(psi, 8) == pytest.approx(1.5)


def test_one_peak_flops_table_for_the_planner_and_the_engines_mfu() -> None:
    from parallel.planner.hardware import HARDWARE, PEAK_FLOPS, cuda_peak_flops

    assert all(HARDWARE[k].peak_flops is PEAK_FLOPS[k] for k in HARDWARE)
    assert cuda_peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == HARDWARE["h100"].peak_flops["bfloat16"]
    assert cuda_peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756e12  # before the SXM entry it contains
    assert cuda_peak_flops("NVIDIA H200", "float32") == HARDWARE["h200"].peak_flops["float32"]
    assert cuda_peak_flops("NVIDIA GeForce RTX 4090", "bfloat16") is None
