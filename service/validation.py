"""Everything that refuses a job at submit time, beyond the spec's own pydantic checks.

The engine's `parallel.dims.ParallelDims` is the authority on layouts (it imports torch, which
is fine in the server); it is checked at the smallest and largest world the job may run at.
Without it (a light install) the pure checks in service.sizing stand in.
"""

from __future__ import annotations

import re
from typing import Any

from service import sizing

# "tp=3 does not divide ..." -> parallelism.tp; "training.seq_len=..." -> training.seq_len
_FIELD_OF_MESSAGE = re.compile(r"^\s*(?:pp stages|([a-z_]+(?:\.[a-z_]+)*)(?:\*2)?=)")
_PARALLEL_SIZES = {"tp", "pp", "cp", "ep", "dp_shard", "dp_replicate", "world_size"}


def _field_of(message: str) -> str:
    m = _FIELD_OF_MESSAGE.match(message)
    if m is None:
        return "parallelism"
    name = m.group(1) or "pp"
    if name in _PARALLEL_SIZES:
        return "resources.dp" if name == "world_size" else f"parallelism.{name}"
    return name if "." in name else f"parallelism.{name}"


def _split_messages(text: str) -> list[str]:
    """ParallelDims joins its messages with "; ", and each message may hold "; " itself."""
    out: list[str] = []
    for piece in text.split("; "):
        if out and not _FIELD_OF_MESSAGE.match(piece):
            out[-1] += "; " + piece
        else:
            out.append(piece)
    return out


def engine_layout_problems(spec: Any) -> list[tuple[str, str]] | None:
    """ParallelDims' verdict at dp.min and dp.max, or None when the engine is not installed."""
    try:
        from parallel.dims import ParallelDims, ParallelDimsError
    except ImportError:
        return None
    p = spec.parallelism
    if p.auto:
        return []
    dp_min, dp_max = sizing.dp_range(spec)
    mp = sizing.model_parallel_size(spec)
    found: dict[int, list[str]] = {}
    for dp in sorted({dp_min, dp_max or dp_min}):
        try:
            dims = ParallelDims(
                dp_replicate=p.dp_replicate, dp_shard=-1, cp=p.cp, tp=p.tp, pp=p.pp, ep=p.ep, world_size=dp * mp
            )
            dims.validate(spec.model, spec.training, p)
            found[dp] = []
        except ParallelDimsError as e:
            found[dp] = _split_messages(str(e))
    problems: list[tuple[str, str]] = []
    for dp, parts in found.items():
        for part in parts:
            everywhere = all(part in other for other in found.values())
            item = (_field_of(part), part if everywhere else f"at dp={dp}: {part}")
            if item not in problems:
                problems.append(item)
    return problems


def job_problems(spec: Any, cluster_total: dict[str, float] | None = None) -> list[tuple[str, str]]:
    """Every (field, message) that stops this job from ever running; empty when it can run."""
    engine = engine_layout_problems(spec)
    layout = sizing.model_layout_problems(spec) if engine is None and not spec.parallelism.auto else engine or []
    return layout + sizing.dp_problems(spec) + sizing.cluster_problems(spec, cluster_total) + _extras_problems(spec)


def _extras_problems(spec: Any) -> list[tuple[str, str]]:
    """Optional features whose package is missing where the job's supervisor would run."""
    import importlib.util

    if getattr(spec, "tensorboard", False) and importlib.util.find_spec("tensorboard") is None:
        return [("tensorboard", "tensorboard: true needs the tensorboard package: "
                 "pip install 'unbroken[tensorboard]', or set tensorboard: false")]
    return []
