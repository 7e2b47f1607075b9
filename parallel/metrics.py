"""Throughput metrics: FLOPs per token, MFU, peak memory.

FLOPs per token follow torchtitan's definition:
    6 * N + 12 * n_layers * n_heads * head_dim * seq_len
where N counts the parameters a token passes through, excluding the token embedding (a lookup,
no matmul): for MoE layers only top_k of num_experts experts are counted. 6N is forward (2N)
plus backward (4N) of the matmuls; the second term is the attention scores and values
(QK^T and AV, forward and backward), not counted in N. MFU = achieved FLOP/s / peak FLOP/s
of the device, summed over ranks; None where the peak is unknown (CPU, unlisted GPUs).
"""

from __future__ import annotations

import resource
import sys

import torch

from parallel.config import ModelConfig

# Dense peak FLOP/s per device (no sparsity), by dtype. bf16 from tensor cores; float32 is the
# plain (non-TF32) FP32 rate, as the trainer runs fp32 matmuls in full precision.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"bfloat16": 989e12, "float32": 67e12},
    "H100 PCIe": {"bfloat16": 756e12, "float32": 51e12},
    "H100": {"bfloat16": 989e12, "float32": 67e12},  # SXM / HBM3
    "A100": {"bfloat16": 312e12, "float32": 19.5e12},
}


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts from the config: total, embedding, and active per token (MoE)."""
    d, hd = cfg.dim, cfg.head_dim
    attn = d * cfg.n_heads * hd * 2 + d * cfg.kv_heads * hd * 2
    norms = 2 * d
    dense_ffn = 3 * d * cfg.ffn_dim
    total = active = 0
    for layer in range(cfg.n_layers):
        moe = cfg.moe is not None and layer % cfg.moe.every_n_layers == cfg.moe.every_n_layers - 1
        if moe:
            assert cfg.moe is not None
            hidden = cfg.moe.hidden_dim or cfg.ffn_dim
            expert = 3 * d * hidden
            router = d * cfg.moe.num_experts
            total += attn + norms + router + cfg.moe.num_experts * expert
            active += attn + norms + router + cfg.moe.top_k * expert
        else:
            total += attn + norms + dense_ffn
            active += attn + norms + dense_ffn
    embedding = cfg.vocab_size * d
    output = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    total += embedding + output + d
    active += output + d + (cfg.vocab_size * d if cfg.tie_embeddings else 0)
    return {"total": total, "embedding": embedding, "active_non_embedding": active}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    n = param_counts(cfg)["active_non_embedding"]
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len


def device_peak_flops(device: torch.device, dtype: str) -> float | None:
    """Peak FLOP/s of one device for `dtype`, or None where unknown (CPU, unlisted GPUs)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key in PEAK_FLOPS:  # ordered so "H100 PCIe" is tried before "H100"
        if key in name and (key != "H100 PCIe" or "PCIe" in name):
            return PEAK_FLOPS[key].get(dtype)
    return None


def mfu(tokens_per_s: float, flops_per_tok: float, peak_per_device: float | None, n_devices: int) -> float | None:
    if peak_per_device is None:
        return None
    return tokens_per_s * flops_per_tok / (peak_per_device * n_devices)


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA max_memory_allocated on GPUs; the process's peak resident set on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # Linux: VmHWM is this address space's own high-water mark. ru_maxrss is not: it survives
    # exec, so a rank started by a large parent (a test runner, say) reports the parent's peak.
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)
