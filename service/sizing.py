"""How many workers a job needs, and what each worker asks of the cluster.

Pure arithmetic on a JobSpec (no torch, no ray), shared by the API's checks at submit time
and the scheduler's gang admission.
"""

from __future__ import annotations

from typing import Any

# Ray's resource names for the two built-in kinds.
CPU = "CPU"
GPU = "GPU"


def model_parallel_size(spec: Any) -> int:
    """Workers per data-parallel replica: tp × pp × cp (ep lives inside dp×cp, it adds no ranks)."""
    p = spec.parallelism
    return int(p.tp * p.pp * p.cp)


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


def gang_demand(spec: Any, workers: int | None = None) -> dict[str, float]:
    """Resources for `workers` workers (default: the minimum world), all or nothing."""
    n = job_world_size(spec)[0] if workers is None else workers
    return {k: v * n for k, v in worker_resources(spec).items()}


def max_workers_fitting(per_worker: dict[str, float], free: dict[str, float]) -> int | None:
    """How many workers of this shape fit in `free`; None if the shape asks for nothing."""
    counts = [int(free.get(k, 0.0) // v + 1e-9) if v > 0 else None for k, v in per_worker.items()]
    counts = [c for c in counts if c is not None]
    return min(counts) if counts else None


def fits(demand: dict[str, float], free: dict[str, float]) -> bool:
    return all(free.get(k, 0.0) + 1e-9 >= v for k, v in demand.items())


def layout_problems(spec: Any, cluster_total: dict[str, float] | None = None) -> list[tuple[str, str]]:
    """Every reason the job's layout cannot run, as (field, message naming the fix): the model
    checks below (the engine's own ParallelDims checks are stricter; see service.validation),
    the dp range, and (when `cluster_total` is given) that the minimum gang fits the cluster."""
    if spec.parallelism.auto:
        return cluster_problems(spec, cluster_total)
    return model_layout_problems(spec) + dp_problems(spec) + cluster_problems(spec, cluster_total)


def model_layout_problems(spec: Any) -> list[tuple[str, str]]:
    """Sizes that must divide the model: tp | heads, pp stages <= layers, cp | seq_len, ep | experts."""
    problems: list[tuple[str, str]] = []
    m, p, t = spec.model, spec.parallelism, spec.training
    if m.n_heads % p.tp:
        problems.append(("parallelism.tp", f"tp={p.tp} does not divide model.n_heads={m.n_heads}; pick a divisor"))
    elif m.kv_heads % p.tp:
        problems.append(
            ("parallelism.tp", f"tp={p.tp} does not divide model.n_kv_heads={m.kv_heads}; pick a divisor")
        )
    stages = p.pp * p.pp_stages_per_rank
    if p.pp > 1 and stages > m.n_layers:
        problems.append(
            ("parallelism.pp", f"pp×stages_per_rank={stages} exceeds model.n_layers={m.n_layers}; lower pp")
        )
    if p.pp_split is not None:
        if len(p.pp_split) != stages:
            problems.append(("parallelism.pp_split", f"has {len(p.pp_split)} entries; it needs {stages}"))
        elif sum(p.pp_split) != m.n_layers:
            problems.append(
                ("parallelism.pp_split", f"sums to {sum(p.pp_split)}; it must sum to model.n_layers={m.n_layers}")
            )
    if p.cp > 1 and t.seq_len % p.cp:
        problems.append(
            ("parallelism.cp", f"cp={p.cp} does not divide training.seq_len={t.seq_len}; pick a divisor")
        )
    if t.seq_len > m.max_seq_len:
        problems.append(("training.seq_len", f"{t.seq_len} exceeds model.max_seq_len={m.max_seq_len}"))
    if m.moe is not None and p.ep > 1 and m.moe.num_experts % p.ep:
        problems.append(
            ("parallelism.ep", f"ep={p.ep} does not divide model.moe.num_experts={m.moe.num_experts}")
        )
    return problems


def dp_problems(spec: Any) -> list[tuple[str, str]]:
    """resources.dp against the parallelism section."""
    problems: list[tuple[str, str]] = []
    p = spec.parallelism
    dp_min, _ = dp_range(spec)
    if p.dp_shard > 0:
        dp_fixed = p.dp_replicate * p.dp_shard
        if spec.resources.dp.max is not None and spec.resources.dp.max > dp_fixed:
            problems.append(
                (
                    "resources.dp.max",
                    f"{spec.resources.dp.max} exceeds the parallelism's dp_replicate×dp_shard={dp_fixed}; "
                    "lower it or set parallelism.dp_shard: -1",
                )
            )
        if dp_min > dp_fixed:
            problems.append(
                ("resources.dp.min", f"{dp_min} exceeds the parallelism's dp_replicate×dp_shard={dp_fixed}")
            )
    if p.dp_replicate > 1 and dp_min % p.dp_replicate:
        problems.append(
            ("resources.dp.min", f"{dp_min} is not a multiple of parallelism.dp_replicate={p.dp_replicate}")
        )
    return problems


def cluster_problems(spec: Any, cluster_total: dict[str, float] | None) -> list[tuple[str, str]]:
    """The minimum gang must fit the whole cluster (not only what is free now)."""
    problems: list[tuple[str, str]] = []
    if cluster_total is not None:
        demand = gang_demand(spec)
        for k, v in demand.items():
            have = cluster_total.get(k, 0.0)
            if have + 1e-9 < v:
                min_world = job_world_size(spec)[0]
                field = {CPU: "resources.cpus_per_worker", GPU: "resources.gpus_per_worker"}.get(
                    k, f"resources.custom.{k}"
                )
                problems.append(
                    (
                        field,
                        f"the minimum world of {min_world} workers needs {v:g} {k} but the whole cluster "
                        f"has {have:g}; lower resources.dp.min, the parallel sizes or the per-worker ask",
                    )
                )
    return problems
