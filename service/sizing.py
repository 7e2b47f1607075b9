"""How many workers a job needs, and what each worker asks of the cluster.

Pure arithmetic on a JobSpec (no torch, no ray), shared by the API's checks at submit time
and the scheduler's gang admission. What a layout needs is the layout authority's
(parallel/layout_rules.py); this module asks it about the job's dp range.
"""

from __future__ import annotations

from typing import Any

from parallel import layout_rules as rules

# Ray's resource names for the two built-in kinds.
CPU = "CPU"
GPU = "GPU"


def model_parallel_size(spec: Any) -> int:
    """Workers per data-parallel replica (parallel.layout_rules.model_parallel_size: tp × pp × cp)."""
    return rules.model_parallel_size(spec.parallelism)


def dp_range(spec: Any) -> tuple[int, int | None]:
    """(dp_min, dp_max) of the data-parallel degree; dp_max None means "fill what the cluster has".

    dp_max is resources.dp.max when set, else dp_replicate × dp_shard when dp_shard is a size,
    else None (dp_shard = -1 with no max).
    """
    p = spec.parallelism
    dp_min = int(spec.resources.dp.min)
    if spec.resources.dp.max is not None:
        return dp_min, int(spec.resources.dp.max)
    if p.dp_shard > 0:
        return dp_min, int(p.dp_replicate * p.dp_shard)
    return dp_min, None


def job_world_size(spec: Any) -> tuple[int, int | None]:
    """(min_world, max_world) in workers: dp × tp × pp × cp; max_world None means fill the cluster."""
    dp_min, dp_max = dp_range(spec)
    mp = model_parallel_size(spec)
    return dp_min * mp, (None if dp_max is None else dp_max * mp)


def worker_resources(spec: Any) -> dict[str, float]:
    """Ray resources one worker asks for."""
    r = spec.resources
    out: dict[str, float] = {}
    if r.cpus_per_worker:
        out[CPU] = float(r.cpus_per_worker)
    if r.gpus_per_worker:
        out[GPU] = float(r.gpus_per_worker)
    for k, v in r.custom.items():
        if v:
            out[k] = out.get(k, 0.0) + float(v)
    return out


def spare_replicas(spec: Any) -> int:
    """Warm spare replicas the job keeps beside its group (resources.spares).

    The one rule about their cost: a spare holds a whole replica's resources, so a job holds its dp
    replicas plus its spares. Admission asks for dp.min + spares replicas (gang_demand) and the
    scheduler counts a running job at what it runs plus its spares (service.scheduling.snapshot.JobView,
    built with this number), so no other job is admitted into capacity the spares take."""
    return int(getattr(spec.resources, "spares", 0) or 0)


def gang_demand(spec: Any, workers: int | None = None) -> dict[str, float]:
    """Resources for `workers` workers, all or nothing (default: the minimum world plus the spares'
    workers, what a job needs to be admitted: see spare_replicas)."""
    if workers is None:
        workers = job_world_size(spec)[0] + spare_replicas(spec) * model_parallel_size(spec)
    return {k: v * workers for k, v in worker_resources(spec).items()}


def max_workers_fitting(per_worker: dict[str, float], free: dict[str, float]) -> int | None:
    """How many workers of this shape fit in `free`; None if the shape asks for nothing."""
    counts = [int(free.get(k, 0.0) // v + 1e-9) if v > 0 else None for k, v in per_worker.items()]
    counts = [c for c in counts if c is not None]
    return min(counts) if counts else None


def fits(demand: dict[str, float], free: dict[str, float]) -> bool:
    return all(free.get(k, 0.0) + 1e-9 >= v for k, v in demand.items())


def layout_problems(spec: Any, cluster_total: dict[str, float] | None = None) -> list[tuple[str, str]]:
    """Every reason the job's layout cannot run, as (field, message naming the fix): the layout
    authority's rules at the smallest and largest dp the job may run at, its dp range, and (when
    `cluster_total` is given) that the minimum gang fits the cluster."""
    layout = [] if spec.parallelism.auto else model_layout_problems(spec)  # auto: the planner's to choose
    return layout + dp_problems(spec) + cluster_problems(spec, cluster_total)


def model_layout_problems(spec: Any) -> list[tuple[str, str]]:
    """The layout (parallel.layout_rules.layout_at_dp) at resources.dp.min and at its max, judged by the layout
    authority; a problem found at one of them only says at which dp."""
    p = spec.parallelism
    dp_min, dp_max = dp_range(spec)
    found = {
        dp: rules.layout_problems(rules.layout_at_dp(p, dp), spec.model, spec.training, dp * model_parallel_size(spec))
        for dp in sorted({dp_min, dp_max or dp_min})
    }
    problems: list[tuple[str, str]] = []
    for dp, here in found.items():
        for x in here:
            everywhere = all(x in other for other in found.values())
            item = (x.field, str(x) if everywhere else f"at dp={dp}: {x}")
            if item not in problems:
                problems.append(item)
    return problems


def dp_problems(spec: Any) -> list[tuple[str, str]]:
    """resources.dp against the parallelism section (parallel.layout_rules.dp_range_problems), and spares
    against the dp range."""
    dp_min, dp_max = dp_range(spec)
    problems = [x.pair() for x in rules.dp_range_problems(spec.parallelism, dp_min, spec.resources.dp.max)]
    spares = spare_replicas(spec)
    if spares and dp_max is None and not spec.parallelism.auto:
        problems.append(("resources.spares", f"spares={spares} needs a bounded data-parallel degree: this job grows "
                         "to fill the cluster (parallelism.dp_shard: -1 without resources.dp.max), so no "
                         "capacity would be left for spares; set resources.dp.max, or spares: 0"))
    return problems


def cluster_problems(spec: Any, cluster_total: dict[str, float] | None) -> list[tuple[str, str]]:
    """The minimum gang, with the job's spares, must fit the whole cluster (not only what is free now).
    When the gang alone fits and only the spares do not, resources.spares is the field to fix."""
    problems: list[tuple[str, str]] = []
    if cluster_total is not None:
        min_world = job_world_size(spec)[0]
        alone = gang_demand(spec, min_world)
        spares = spare_replicas(spec)
        spare_workers = spares * model_parallel_size(spec)
        for k, v in gang_demand(spec).items():
            have = cluster_total.get(k, 0.0)
            if have + 1e-9 >= v:
                continue
            if have + 1e-9 >= alone.get(k, 0.0):
                problems.append(("resources.spares", f"the minimum world of {min_world} workers plus spares={spares} "
                                 f"({spare_workers} more workers) needs {v:g} {k} but the whole cluster has "
                                 f"{have:g}; lower resources.spares or resources.dp.min"))
                continue
            field = {CPU: "resources.cpus_per_worker", GPU: "resources.gpus_per_worker"}.get(
                k, f"resources.custom.{k}"
            )
            problems.append(
                (
                    field,
                    f"the minimum world of {min_world} workers needs {alone.get(k, 0.0):g} {k} but the whole "
                    f"cluster has {have:g}; lower resources.dp.min, the parallel sizes or the per-worker ask",
                )
            )
    return problems
