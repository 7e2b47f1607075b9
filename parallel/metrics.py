"""Throughput metrics of a running engine: FLOPs per token, MFU, peak memory.

The formulas are the planner's, so the planned and the measured MFU mean the same thing: FLOPs
per token (torchtitan's 6·N + 12·L·H·Q·T) in parallel/planner/flops.py, parameter counts in
parallel/planner/params.py, the devices' peak FLOP/s in parallel/planner/hardware.py. MFU =
achieved FLOP/s / peak FLOP/s of the device, summed over ranks; None where the peak is unknown
(CPU, unlisted GPUs).
"""

from __future__ import annotations

import resource
import sys

import torch

from parallel.config import ModelConfig
from parallel.planner.flops import flops_per_token
from parallel.planner.hardware import cuda_peak_flops
from parallel.planner.params import count_params

__all__ = ["device_peak_flops", "flops_per_token", "mfu", "param_counts", "peak_memory_bytes"]


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts (parallel/planner/params.py): total, embedding, and N of 6·N (active, no input
    embedding)."""
    pc = count_params(cfg)
    return {"total": pc.total, "embedding": pc.embedding, "active_non_embedding": pc.flops_params}


def device_peak_flops(device: torch.device, dtype: str) -> float | None:
    """Peak FLOP/s of one device for `dtype` (parallel/planner/hardware.py's table), or None where
    unknown (CPU, unlisted GPUs)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return cuda_peak_flops(torch.cuda.get_device_name(device), dtype)


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
