"""`--explain`: every estimate of one candidate as formula, numbers filled in, and result."""

from __future__ import annotations

from parallel.config import ModelConfig, TrainConfig
from parallel.planner.params import count_params
from parallel.planner.search import Candidate
from parallel.planner.terms import Term, fmt_bytes, fmt_time, g


def _line(t: Term, unit: str) -> str:
    value = {"bytes": fmt_bytes, "seconds": fmt_time}.get(unit, g)(t.value)
    return f"  {t.name}: {t.formula}\n      = {t.filled}\n      = {value}"


def explain(c: Candidate, model: ModelConfig, train: TrainConfig) -> list[str]:
    """Lines of text for a terminal; the same Terms the estimate itself summed."""
    pc = count_params(model)
    hw = c.time
    mem = c.memory
    out = [
        f"layout {c.layout.label()} on {c.memory.capacity / 2**30:.1f} GiB usable per device",
        f"parameters: Ψ_total={g(pc.total)} (active {g(pc.active)}, experts {g(pc.experts_total)}); "
        f"N for FLOPs (no input embedding)={g(pc.flops_params)}",
        "",
        "FLOPs",
        _line(hw.flops_per_token, "flops"),
        "",
        f"memory per device (worst rank: {mem.rank}); peak = persistent + max(forward/backward, optimizer step)",
    ]
    out += [_line(t, "bytes") for t in mem.persistent]
    out.append("  -- forward/backward transient")
    out += [_line(t, "bytes") for t in mem.fwd_bwd]
    out.append("  -- optimizer step transient")
    out += [_line(t, "bytes") for t in mem.optimizer_step]
    if mem.host:
        out.append("  -- in host memory (cpu_offload)")
        out += [_line(t, "bytes") for t in mem.host]
    out.append(f"  peak = {fmt_bytes(mem.peak)} of {fmt_bytes(mem.capacity)} usable")
    out += ["", "time per step = compute + bubble + Σcomm − hidden + optimizer + dispatch"]
    out += [_line(t, "seconds") for t in hw.terms()]
    out.append(
        f"  step = {fmt_time(hw.step_time)}; tokens/s = {g(hw.tokens_per_step)} / {fmt_time(hw.step_time)} "
        f"= {hw.tokens_per_s:,.0f}; MFU = F_tok × tokens/s / (world × peak) = {hw.mfu:.3f}"
    )
    out += [f"  note: {n}" for n in [*hw.notes, *mem.notes, *c.notes]]
    return out
