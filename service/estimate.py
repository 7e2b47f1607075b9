"""How long a job would run, told at submit time: the planner's step time for the job's layout on
the cluster it would run on (service.autolayout.cluster_for_job), times its steps; and the warnings
a submit answer carries for a job that would run for months.

Pure arithmetic (no torch, no ray). An estimate is the planner's model, not a measurement; where
the planner has nothing to say (no cluster view, a layout it cannot place) there is none.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from service import sizing

LONG_JOB_S = 30 * 86400  # an estimate above this is worth a warning
LONG_JOB_STEPS = 100_000_000  # with no estimate, this many steps alone is


@dataclass(frozen=True)
class RunEstimate:
    step_time_s: float
    duration_s: float  # step_time_s x training.steps, at the job's largest size on this cluster
    basis: str  # which layout on which cluster the planner timed

    def to_dict(self) -> dict[str, Any]:
        return {"step_time_s": self.step_time_s, "duration_s": self.duration_s, "basis": self.basis}


def estimate_run(spec: Any, cluster_total: Mapping[str, float] | None, candidate: Any = None) -> RunEstimate | None:
    """The planner's estimate for `spec` (a concrete layout, or `candidate`: the planner.Candidate that
    `parallelism: auto` chose) on the cluster `cluster_total` describes; None when it has none."""
    from parallel.layout_rules import layout_at_dp
    from parallel.planner.hardware import PlanError
    from parallel.planner.layout import layout_from_config
    from parallel.planner.search import Candidate, evaluate
    from service.autolayout import LayoutRefused, cluster_for_job

    if cluster_total is None:
        return None
    try:
        job_cluster = cluster_for_job(spec, cluster_total)
        if candidate is None:
            if spec.parallelism.auto:
                return None
            mp = sizing.model_parallel_size(spec)
            dp = job_cluster.cluster.world // mp  # the largest dp this cluster holds, within the job's range
            if dp < sizing.dp_range(spec)[0]:
                return None
            layout, _ = layout_from_config(layout_at_dp(spec.parallelism, dp), dp * mp)
            if layout is None:
                return None
            candidate = evaluate(spec.model, spec.training, layout, job_cluster.cluster)
            if not isinstance(candidate, Candidate):
                return None
    except (LayoutRefused, PlanError, ValueError, ZeroDivisionError):
        return None
    step_s = float(candidate.step_time)
    basis = (f"the planner's step time for {candidate.layout.label()} on {job_cluster.cluster.describe()} "
             f"({job_cluster.source})")
    return RunEstimate(step_s, step_s * spec.training.steps, basis)


def human_duration(seconds: float) -> str:
    """'45 s', '12 min', '3.5 h', '41 days', '31,700 years'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds < 730 * 86400:
        return f"{seconds / 86400:,.0f} days"
    return f"{seconds / (365.25 * 86400):,.0f} years"


def long_job_warnings(spec: Any, estimate: RunEstimate | None) -> list[str]:
    """Why this job may be longer than meant; [] when nothing stands out."""
    steps = spec.training.steps
    if estimate is not None and estimate.duration_s > LONG_JOB_S:
        return [f"training.steps={steps:,} at ~{estimate.step_time_s:.3g} s a step would run for "
                f"~{human_duration(estimate.duration_s)} ({estimate.basis}); lower training.steps if that "
                "is not what you meant"]
    if estimate is None and steps > LONG_JOB_STEPS:
        return [f"training.steps={steps:,} is a very long job, and there is no step-time estimate for this "
                "cluster to say how long; lower training.steps if that is not what you meant"]
    return []
