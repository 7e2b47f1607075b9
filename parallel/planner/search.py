"""Enumerate the layouts of a cluster, estimate each, keep those that fit, rank them by tokens/s.

- `plan(spec, cluster)`: every candidate with its estimates and every rejected layout with its
  reasons. With `parallelism: auto` the dims the spec sets explicitly stay fixed and the rest are
  searched; with a concrete parallelism section all layouts are explored and the spec's own
  layout is evaluated as `requested`.
- `choose_layout(model, train, parallel, cluster)`: the best fitting layout as a ParallelConfig,
  filling what the spec leaves open (auto dims, or dp_shard=-1); PlanError with reasons if none fits.
- `check_fits(model, train, parallel, cluster)`: reasons a layout cannot run here (empty: it fits),
  for re-checking a job when its cluster is resized.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from parallel.config import EngineConfig, ModelConfig, ParallelConfig, TrainConfig
from parallel.layout_rules import ep_problems, stages_per_rank
from parallel.planner.hardware import Cluster, PlanError
from parallel.planner.layout import (
    Layout,
    layout_from_config,
    request_reasons,
    structural_reasons,
    with_microbatches,
)
from parallel.planner.memory import MemoryEstimate, estimate_memory, memory_reasons
from parallel.planner.timing import TimeEstimate, estimate_time

SEARCH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")


@dataclass
class Candidate:
    layout: Layout
    memory: MemoryEstimate
    time: TimeEstimate
    notes: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.time.tokens_per_s

    @property
    def step_time(self) -> float:
        return self.time.step_time

    def to_dict(self) -> dict[str, Any]:
        return {
            "layout": self.layout.label(), "parallelism": self.layout.to_dict(),
            "tokens_per_s": self.tokens_per_s, "step_time_s": self.step_time, "mfu": self.time.mfu,
            "peak_memory_bytes": self.memory.peak, "capacity_bytes": self.memory.capacity,
            "memory": self.memory.to_dict(), "time": self.time.to_dict(), "notes": self.notes,
        }


@dataclass
class Rejected:
    layout: Layout | None
    label: str
    reasons: list[str]
    memory: MemoryEstimate | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "layout": self.label, "parallelism": self.layout.to_dict() if self.layout else None,
            "reasons": self.reasons, "peak_memory_bytes": self.memory.peak if self.memory else None,
        }


@dataclass
class PlanResult:
    cluster: Cluster
    candidates: list[Candidate]  # fitting, best first
    rejected: list[Rejected]
    errors: list[str] = field(default_factory=list)  # the request itself is impossible
    requested: Candidate | Rejected | None = None  # the spec's own layout, when it names one
    fixed: dict[str, int] = field(default_factory=dict)

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None

    @property
    def ok(self) -> bool:
        return self.best is not None

    def reasons(self, limit: int = 5) -> list[str]:
        """Why nothing fits: the request's errors, else the distinct reasons of the rejected layouts."""
        if self.errors:
            return list(self.errors)
        seen: dict[str, None] = {}  # ordered set: a list's `in` made this quadratic (minutes at 10k+ layouts)
        for rej in sorted(self.rejected, key=lambda r: r.memory.peak if r.memory else float("inf")):
            for reason in rej.reasons:
                seen.setdefault(f"{rej.label}: {reason}", None)
                if len(seen) >= limit:
                    return list(seen)
        return list(seen)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(model: ModelConfig, world: int, cluster: Cluster, base: ParallelConfig,
                      fixed: Mapping[str, int]) -> Iterator[Layout]:
    """Every factorisation world = dp_replicate·dp_shard·cp·tp·pp (and ep within dp_shard·cp) that
    respects `fixed`. tp stays inside a node unless fixed: its per-layer collectives would cross the network."""
    per_node = cluster.devices_per_node

    def choices(dim: str, n: int) -> Iterable[int]:
        if dim in fixed:
            return [fixed[dim]] if n % fixed[dim] == 0 else []
        return _divisors(n)

    for pp in choices("pp", world):
        if "pp" not in fixed and pp > model.n_layers:
            continue
        for tp in choices("tp", world // pp):
            if "tp" not in fixed and tp > per_node:
                continue
            for cp in choices("cp", world // (pp * tp)):
                rest = world // (pp * tp * cp)
                for rep in choices("dp_replicate", rest):
                    shard = rest // rep
                    if "dp_shard" in fixed and fixed["dp_shard"] != shard:
                        continue
                    eps = [1]
                    if model.moe is not None:
                        eps = [e for e in _divisors(model.moe.num_experts) if not ep_problems(shard, cp, e)]
                    if "ep" in fixed:
                        eps = [fixed["ep"]]
                    for ep in eps:
                        yield Layout(
                            dp_replicate=rep, dp_shard=shard, cp=cp, tp=tp, pp=pp, ep=ep,
                            zero_stage=base.zero_stage, pp_schedule=base.pp_schedule,
                            pp_microbatches=base.pp_microbatches if pp > 1 else None,
                            pp_stages_per_rank=stages_per_rank(base.pp_schedule, pp, base.pp_stages_per_rank),
                            sequence_parallel=base.sequence_parallel, cpu_offload=base.cpu_offload,
                            fsdp_unit_mib=base.fsdp_unit_mib,
                        )


def evaluate(model: ModelConfig, train: TrainConfig, layout: Layout, cluster: Cluster, *,
             activation_model: str = "engine") -> Candidate | Rejected:
    """One layout: a Candidate if it can run and fits, else Rejected with every reason."""
    reasons = structural_reasons(layout, model, train)
    if reasons:
        return Rejected(layout, layout.label(), reasons)
    mem = estimate_memory(model, train, layout, cluster, activation_model=activation_model)
    reasons = memory_reasons(mem, layout, train)
    if reasons:
        return Rejected(layout, layout.label(), reasons, mem)
    notes: list[str] = []
    if layout.tp > cluster.devices_per_node:
        notes.append(f"tp={layout.tp} spans nodes: its per-layer all-reduces cross the network")
    return Candidate(layout, mem, estimate_time(model, train, layout, cluster), notes)


def _rank_key(c: Candidate) -> tuple[float, int, float]:
    """Fastest first; within 0.5% (below the model's precision) the simpler layout, then the leaner one."""
    simplicity = sum(getattr(c.layout, d) > 1 for d in SEARCH_DIMS)
    bucket = round(math.log(c.tokens_per_s) / math.log(1.005))
    return (-bucket, simplicity, c.memory.peak)


def fixed_dims(parallel: ParallelConfig, explore: bool, allowed: Iterable[str] | None = None) -> dict[str, int]:
    """Dims the search must keep. auto: those the spec sets explicitly (dp_shard=-1 counts as open);
    concrete: all of them unless exploring (dp_shard=-1 stays open). Dims outside `allowed` (and
    not set by the spec) are pinned to 1, e.g. to what a given engine build can run."""
    if parallel.auto:
        given = parallel.model_fields_set
    elif explore:
        given = set()
    else:
        given = set(SEARCH_DIMS)
    out = {d: getattr(parallel, d) for d in SEARCH_DIMS if d in given}
    if out.get("dp_shard") == -1:
        del out["dp_shard"]
    if allowed is not None:
        bad = set(allowed) - set(SEARCH_DIMS)
        if bad:
            raise ValueError(f"unknown dims {sorted(bad)}; allowed dims are among {SEARCH_DIMS}")
        for d in SEARCH_DIMS:
            if d not in allowed and d not in out:
                out[d] = 1
    return out


def search(model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, cluster: Cluster,
           fixed: Mapping[str, int], *, activation_model: str = "engine") -> PlanResult:
    world = cluster.world
    errors = _request_errors(model, train, parallel, cluster, fixed)
    if errors:
        return PlanResult(cluster, [], [], errors=errors, fixed=dict(fixed))
    candidates: list[Candidate] = []
    rejected: list[Rejected] = []
    for layout in enumerate_layouts(model, world, cluster, parallel, fixed):
        res = evaluate(model, train, with_microbatches(layout, train), cluster, activation_model=activation_model)
        (candidates if isinstance(res, Candidate) else rejected).append(res)
    candidates.sort(key=_rank_key)
    result = PlanResult(cluster, candidates, rejected, fixed=dict(fixed))
    if not candidates and not rejected:
        result.errors.append(f"no layout of {world} devices matches the fixed sizes {dict(fixed)}; "
                             f"make their product divide {world}")
    return result


def _request_errors(model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, cluster: Cluster,
                    fixed: Mapping[str, int]) -> list[str]:
    world = cluster.world
    errs = request_reasons(model, train)
    if errs:
        return errs
    prod = 1
    for d in ("dp_replicate", "dp_shard", "cp", "tp", "pp"):
        prod *= fixed.get(d, 1)
    if world % prod:
        named = "×".join(f"{d}={fixed[d]}" for d in ("dp_replicate", "dp_shard", "cp", "tp", "pp") if d in fixed)
        return [f"{named} = {prod} does not divide the {world} devices; use {world} devices "
                f"that are a multiple of {prod} or change those sizes"]
    return []


def _as_engine(spec: Any) -> EngineConfig:
    if isinstance(spec, EngineConfig):
        return spec
    if isinstance(spec, Mapping):
        keys = ("model", "data", "training", "parallelism")
        return EngineConfig.model_validate({k: spec[k] for k in keys if k in spec})
    raise TypeError(f"plan() takes an EngineConfig/JobSpec or a mapping, got {type(spec).__name__}")


def plan(spec: EngineConfig | Mapping[str, Any], cluster: Cluster, *,
         allowed_dims: Iterable[str] | None = None, activation_model: str = "engine") -> PlanResult:
    """Every layout of the cluster, estimated. activation_model: "engine" (the tensors this engine's
    block keeps) or "korthikanti" (the paper's GPT-layer formula)."""
    cfg = _as_engine(spec)
    model, train, parallel = cfg.model, cfg.training, cfg.parallelism
    result = search(model, train, parallel, cluster, fixed_dims(parallel, explore=True, allowed=allowed_dims),
                    activation_model=activation_model)
    if not parallel.auto:
        layout, reasons = layout_from_config(parallel, cluster.world)
        if layout is None:
            result.requested = Rejected(None, "requested", reasons)
        else:
            result.requested = evaluate(model, train, layout, cluster, activation_model=activation_model)
    return result


def choose_layout(model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, cluster: Cluster, *,
                  allowed_dims: Iterable[str] | None = None) -> ParallelConfig:
    """Fill the open dims with the fastest fitting layout; raises PlanError naming why none fits.
    allowed_dims: the dims the search may set above 1 (default all of SEARCH_DIMS)."""
    result = search(model, train, parallel, cluster, fixed_dims(parallel, explore=False, allowed=allowed_dims))
    if result.best is None:
        raise PlanError(result.reasons() or [f"no layout fits {cluster.describe()}"])
    return result.best.layout.to_parallel_config(parallel)


def check_fits(model: ModelConfig, train: TrainConfig, parallel: ParallelConfig, cluster: Cluster, *,
               allowed_dims: Iterable[str] | None = None) -> list[str]:
    """Reasons this layout cannot run on `cluster` (empty when it fits). auto: whether any layout fits."""
    if parallel.auto:
        try:
            choose_layout(model, train, parallel, cluster, allowed_dims=allowed_dims)
        except PlanError as e:
            return e.reasons
        return []
    layout, reasons = layout_from_config(parallel, cluster.world)
    if layout is None:
        return reasons
    res = evaluate(model, train, layout, cluster)
    return res.reasons if isinstance(res, Rejected) else []
