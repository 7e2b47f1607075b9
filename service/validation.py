"""Everything that refuses a job at submit time, beyond the spec's own pydantic checks.

The layout rules are the layout authority's (parallel/layout_rules.py, no torch), asked through
service.sizing at the smallest and largest dp the job may run at; this module adds what only the
server can know (optional packages where the supervisor runs).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from service import sizing


def job_problems(spec: Any, cluster_total: dict[str, float] | None = None) -> list[tuple[str, str]]:
    """Every (field, message) that stops this job from ever running; empty when it can run."""
    return (sizing.layout_problems(spec, cluster_total) + _extras_problems(spec)
            + _chaos_problems(spec, cluster_total) + _runtime_env_problems(spec))


def _runtime_env_problems(spec: Any) -> list[tuple[str, str]]:
    """runtime_env.pip: the spec has the field, but no job's packages are installed anywhere (its
    processes start from the cluster's own environment), so a job that names some is refused rather
    than started without them. Checked at submission only: a job stored earlier still reads back."""
    pip = spec.runtime_env.pip
    if not pip:
        return []
    return [("runtime_env.pip", f"packages {pip} would not be installed: a job's processes run in the cluster's "
             "own Python environment; install them there (the image in deploy/, or pip on every node) and "
             "remove runtime_env.pip")]


def _chaos_problems(spec: Any, cluster_total: dict[str, float] | None) -> list[tuple[str, str]]:
    """Chaos events at a rank the job never has: beyond its dp range's largest world, or (a job that
    fills the cluster) beyond what the whole cluster holds. Step bounds are the spec's own check."""
    from service.spec import chaos_rank_problems

    if not spec.chaos or spec.parallelism.auto:
        return []
    mp = sizing.model_parallel_size(spec)
    dp_max = sizing.dp_range(spec)[1]
    if dp_max is not None:
        why = f"dp at most {dp_max} (resources.dp.max or the parallelism's dp size) x {mp} a replica"
        return chaos_rank_problems(spec.chaos, dp_max * mp, why)
    fit = sizing.max_workers_fitting(sizing.worker_resources(spec), cluster_total) if cluster_total else None
    if fit is None or fit < mp:
        return []  # no cluster view, or one too small, which cluster_problems reports
    world = fit // mp * mp
    return chaos_rank_problems(spec.chaos, world, f"the whole cluster holds {world} of its workers")


def _extras_problems(spec: Any) -> list[tuple[str, str]]:
    """Optional features whose package is missing where the job's supervisor would run."""
    if getattr(spec, "tensorboard", False) and importlib.util.find_spec("tensorboard") is None:
        return [("tensorboard", "tensorboard: true needs the tensorboard package: "
                 "pip install 'unbroken[tensorboard]', or set tensorboard: false")]
    return []
