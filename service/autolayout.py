"""The layout planner inside the service: the cluster a job would run on, `parallelism: auto`
resolved at submission, and the memory re-check of a smaller data-parallel degree.

- `cluster_for_job(spec, total, ...)`: the planner's Cluster for a job from the cluster's Ray
  resources (or explicit gpus/gpu/nodes), with a sentence saying where it came from.
- `resolve_auto(spec, cluster, total)`: the spec with its auto parallelism replaced by the fastest
  layout that fits and that the job can also run at its smallest size (resources.dp.min), plus
  what to record in the job's `layout_chosen` event. Raises LayoutRefused naming the reasons.
- `check_resize(spec, new_dp, cluster)`: why the job's layout cannot run at `new_dp` (empty: it
  can); the supervisor calls it before shrinking or growing a group. The layout at `new_dp` is
  parallel.layout_rules.layout_at_dp, the one the worker forms.

Pure arithmetic (no torch, no ray): the planner in parallel/planner and service.sizing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from parallel.layout_rules import layout_at_dp
from parallel.planner.hardware import HARDWARE, Cluster, PlanError, make_cluster
from parallel.planner.layout import Layout, layout_from_config
from parallel.planner.search import Candidate, evaluate, plan
from service import sizing

# Ray's accelerator_type resource names (e.g. "accelerator_type:H100", "accelerator_type:A100-80G")
# mapped to the planner's presets, by substring.
_ACCELERATORS = (("h200", "h200"), ("h100", "h100"), ("a100", "a100"))
_MAX_CANDIDATES = 64  # how far down the ranking auto resolution looks for one the dp range allows
# The most devices one plan covers: its cost grows with the device count's divisors (65520 h100s:
# ~5 s; cpu ranks, whose tp is not bounded by a node, ~13 s), and it runs inside a request.
MAX_DEVICES = 16384
MAX_CPU_RANKS = 4096


def max_devices(preset: str) -> int:
    return MAX_CPU_RANKS if preset.lower() == "cpu" else MAX_DEVICES


class LayoutRefused(ValueError):
    """No layout can be chosen or planned; `problems` are (field, message) pairs for a 422."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(f"{f}: {m}" for f, m in self.problems))


@dataclass
class JobCluster:
    """The planner's cluster for a job, and how it was derived (shown to users)."""

    cluster: Cluster
    source: str

    def to_dict(self) -> dict[str, Any]:
        c = self.cluster
        return {"gpu": c.hardware.name, "gpus": c.world, "nodes": c.nodes, "source": self.source}


@dataclass
class AutoLayout:
    """The resolved spec and what was chosen (the `layout_chosen` event's data)."""

    spec: Any
    candidate: Candidate
    cluster: JobCluster
    skipped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def event_message(self) -> str:
        c = self.candidate
        return (f"parallelism: auto chose {c.layout.label()} on {self.cluster.cluster.describe()}: "
                f"~{c.tokens_per_s:,.0f} tokens/s, {c.memory.peak / 2**30:.2f} GiB of "
                f"{c.memory.capacity / 2**30:.2f} GiB per device")

    def event_data(self) -> dict[str, Any]:
        c = self.candidate
        sizes = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
        p = self.spec.parallelism
        return {
            "parallelism": {k: getattr(p, k) for k in (*sizes, "zero_stage", "pp_schedule", "pp_microbatches",
                                                        "pp_stages_per_rank", "cpu_offload")},
            "layout": c.layout.label(),
            "tokens_per_s": c.tokens_per_s,
            "step_time_s": c.step_time,
            "mfu": c.time.mfu,
            "peak_memory_bytes": c.memory.peak,
            "capacity_bytes": c.memory.capacity,
            "cluster": self.cluster.to_dict(),
            "skipped": self.skipped,
            "notes": self.notes,
        }


def _ray_nodes(total: Mapping[str, float]) -> int:
    """Nodes in a Ray resource dict: each node adds 1 to its `node:<ip>` resource."""
    n = sum(v for k, v in total.items() if k.startswith("node:") and k != "node:__internal_head__")
    return max(1, int(round(n)))


def _gpu_preset(total: Mapping[str, float]) -> tuple[str, str | None]:
    """(preset, note): the preset of the cluster's accelerator_type, h100 (with a note) if unknown."""
    kinds = [k.split(":", 1)[1] for k in total if k.startswith("accelerator_type:")]
    for kind in kinds:
        for needle, preset in _ACCELERATORS:
            if needle in kind.lower():
                return preset, None
    seen = ", ".join(kinds) or "none reported"
    return "h100", f"accelerator type {seen} has no planner preset; planned as h100 (pass ?gpu= to choose)"


def cluster_for_job(
    spec: Any,
    total: Mapping[str, float] | None,
    *,
    gpus: int | None = None,
    gpu: str | None = None,
    nodes: int | None = None,
) -> JobCluster:
    """The cluster the job would run on, for the planner.

    Explicit `gpus` (with `gpu`, default h100, and `nodes`) win. Else from `total`, the cluster's
    Ray resources: its GPUs when the job asks GPUs per worker (one device per worker), else the
    cpu preset with as many ranks as the job may use (its max world) or the CPUs hold (CPU /
    resources.cpus_per_worker). Raises LayoutRefused naming the query parameter to pass when
    there is no cluster to read (a store-only server without a cluster view)."""
    if gpu is not None and gpu.lower() not in HARDWARE:
        raise LayoutRefused([("gpu", f"unknown preset {gpu!r}; choose one of {sorted(HARDWARE)}")])
    try:
        if gpus is not None:
            limit = max_devices(gpu or "h100")
            if gpus > limit:
                raise LayoutRefused([("gpus", f"{gpus} devices: the planner covers at most {limit} "
                                              f"{gpu or 'h100'} devices in one plan; ask for fewer")])
            return JobCluster(make_cluster(gpus, gpu or "h100", nodes), "as requested (gpus, gpu, nodes)")
        if total is None:
            raise LayoutRefused([(
                "gpus",
                "this server has no cluster to plan for (store-only, no cluster view): pass the cluster "
                "as ?gpus=N (with &gpu=h100|h200|a100|cpu and &nodes=M)",
            )])
        res = spec.resources
        _, max_world = sizing.job_world_size(spec)
        have_gpus = total.get(sizing.GPU, 0.0)
        if have_gpus >= 1 and res.gpus_per_worker > 0 and (gpu is None or gpu.lower() != "cpu"):
            devices = int(have_gpus // res.gpus_per_worker + 1e-9)
            if max_world is not None:
                devices = min(devices, max_world)
            preset, note = (gpu.lower(), None) if gpu else _gpu_preset(total)
            if devices > max_devices(preset):
                devices = max_devices(preset)
                note = "; ".join(x for x in (note, f"planned for {devices}, the planner's limit") if x)
            n = nodes if nodes is not None else _ray_nodes(total)
            if nodes is None and (devices % n or devices // n > HARDWARE[preset].devices_per_node):
                n = None  # fewer workers than nodes, or an uneven spread: as few full nodes as hold them
            source = (f"the cluster's {have_gpus:g} GPUs at resources.gpus_per_worker="
                      f"{res.gpus_per_worker:g}" + (f", capped at the job's max world {max_world}"
                                                    if max_world is not None else ""))
            return JobCluster(make_cluster(devices, preset, n), source + (f"; {note}" if note else ""))
        cpus = total.get(sizing.CPU, 0.0)
        fill = int(cpus // res.cpus_per_worker + 1e-9) if res.cpus_per_worker > 0 else int(cpus)
        ranks = min(max_world, fill) if max_world is not None and fill >= 1 else (max_world or fill)
        if ranks < 1:
            raise LayoutRefused([(
                "resources.cpus_per_worker",
                f"the cluster's {cpus:g} CPUs hold no worker asking {res.cpus_per_worker:g}; lower it "
                "or pass ?gpus=N to plan for another cluster",
            )])
        why = f"the job's max world {max_world}" if max_world is not None and ranks == max_world else (
            f"the cluster's {cpus:g} CPUs at resources.cpus_per_worker={res.cpus_per_worker:g}")
        preset = gpu.lower() if gpu else "cpu"
        if ranks > max_devices(preset):
            ranks = max_devices(preset)
            why += f", capped at {ranks} (the planner's limit)"
        if have_gpus >= 1 and res.gpus_per_worker == 0:
            why += ("; the cluster has GPUs but the job asks none (resources.gpus_per_worker: 0), so its "
                    "workers run on CPU: set resources.gpus_per_worker: 1 to plan for the GPUs")
        return JobCluster(make_cluster(ranks, preset, nodes), f"{ranks} ranks: {why}")
    except PlanError as e:
        raise LayoutRefused([("nodes" if "node" in r else "gpus", r) for r in e.reasons]) from e


def check_resize(spec: Any, new_dp: int, cluster: Cluster) -> list[str]:
    """Reasons the job cannot run at data-parallel degree `new_dp` on `cluster`'s devices (empty: it can).

    `spec` is a JobSpec with a concrete layout (auto already resolved); tp/pp/cp/ep stay, dp changes
    as the runtime changes it. A smaller dp holds more of the fixed global batch and shards the
    model states over fewer ranks, so it may not fit in memory. `cluster` gives the device (its
    memory per rank); its size is not used. Pure and cheap (~1 ms)."""
    p = spec.parallelism
    if p.auto:
        raise ValueError("check_resize needs a concrete layout; resolve parallelism: auto first (resolve_auto)")
    if new_dp < 1:
        return [f"dp={new_dp}: the data-parallel degree must be at least 1"]
    at = layout_at_dp(p, new_dp)
    world = new_dp * sizing.model_parallel_size(spec)
    layout, reasons = layout_from_config(at, world)
    if layout is None:
        return [f"at dp={new_dp}: {r}" for r in reasons]
    res = evaluate(spec.model, spec.training, layout, cluster)
    if isinstance(res, Candidate):
        return []
    return [f"at dp={new_dp} ({res.label}) on {cluster.hardware.name}: {r}" for r in res.reasons]


def _with_layout(spec: Any, layout: Layout) -> tuple[Any, list[str]]:
    """The spec with `layout` as its parallelism; resources.dp.max lowered to the layout's dp if above."""
    notes: list[str] = []
    data = spec.model_dump(mode="python", round_trip=True)  # python mode keeps SecretStr values intact
    data["parallelism"] = layout.to_parallel_config(spec.parallelism).model_dump(mode="python")
    dp_max = spec.resources.dp.max
    if dp_max is not None and dp_max > layout.dp:
        notes.append(f"resources.dp.max lowered from {dp_max} to the chosen layout's dp={layout.dp}")
        data["resources"]["dp"]["max"] = layout.dp
    return type(spec).model_validate(data), notes


def resolve_auto(spec: Any, job_cluster: JobCluster, total: Mapping[str, float] | None = None) -> AutoLayout:
    """Replace `parallelism: auto` (and its explicitly set sizes, which stay) with a concrete layout.

    Takes the planner's ranking on `job_cluster` and keeps the first layout that the job can also
    run at resources.dp.min (memory and shape, check_resize) and that passes the submit checks
    (service.validation.job_problems against `total`). Raises LayoutRefused naming `parallelism`."""
    from service.validation import job_problems

    if not spec.parallelism.auto:
        raise ValueError("resolve_auto takes a spec with parallelism: auto")
    cluster = job_cluster.cluster
    result = plan(spec, cluster)
    dp_min = sizing.dp_range(spec)[0]
    skipped: list[str] = []
    for cand in result.candidates[:_MAX_CANDIDATES]:
        label, dp = cand.layout.label(), cand.layout.dp
        if dp < dp_min:
            skipped.append(f"{label}: its dp={dp} is below resources.dp.min={dp_min}")
            continue
        resolved, notes = _with_layout(spec, cand.layout)
        if dp_min < dp:
            small = check_resize(resolved, dp_min, cluster)
            if small:
                skipped.append(f"{label}: fits at dp={dp} but not at resources.dp.min={dp_min}: {small[0]}")
                continue
        problems = job_problems(resolved, dict(total) if total is not None else None)
        if problems:
            skipped.append(f"{label}: " + "; ".join(f"{f}: {m}" for f, m in problems))
            continue
        return AutoLayout(resolved, cand, job_cluster, skipped[:10], notes)
    where = f"{cluster.describe()} ({job_cluster.source})"
    if not result.candidates:
        reasons = result.reasons(3)
        msg = f"no layout fits {where}" + (": " + " | ".join(reasons) if reasons else "")
    else:
        msg = (f"{len(result.candidates)} layout(s) fit {where} but none suits the job: "
               + " | ".join(skipped[:3]))
    raise LayoutRefused([("parallelism", msg)])

