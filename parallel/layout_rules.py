"""The layout rules: every rule a parallel layout must keep, written once and called by everyone who
judges a layout: ParallelDims (the engine, parallel/dims.py), the planner (parallel/planner), the
pipeline code (parallel/pp.py), ParallelConfig's own checks, the service's submit checks and sizing
(service/sizing.py, service/validation.py), `parallelism: auto` and resize checks (service/autolayout.py)
and the worker's resize (`layout_at_dp`). Each rule returns `LayoutProblem`s (field, message, fix), so a
caller never recovers a field from a message's text. Imports no torch (the planner and the SDK use it)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from parallel.config import EngineConfig

SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")  # one stage per pp rank
LOOPED_SCHEDULES = ("interleaved_1f1b", "zero_bubble")  # rank r holds stages r, r+pp, ...: >= 2 per rank
V_SCHEDULES = ("zbv",)  # rank r holds stages r and 2·pp−1−r: exactly 2 per rank


@dataclass(frozen=True)
class LayoutProblem:
    """One reason a layout cannot run: the job file's field, what is wrong, and how to fix it."""

    field: str  # e.g. "parallelism.tp", "training.seq_len", "resources.dp.min"
    message: str
    fix: str = ""

    def __str__(self) -> str:
        return f"{self.message}; {self.fix}" if self.fix else self.message

    def pair(self) -> tuple[str, str]:
        """(field, message with its fix): the shape of a 422's field list."""
        return self.field, str(self)


class ParallelDimsError(ValueError):
    """A layout that cannot run; `problems` name each field, what is wrong and the fix."""

    def __init__(self, problems: Sequence[LayoutProblem]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(str(p) for p in self.problems))

    def __reduce__(self) -> tuple[Any, ...]:  # crosses Ray processes with its problems
        return type(self), (self.problems,)


class Sizes(Protocol):
    """The mesh sizes of a layout: ParallelConfig, ParallelDims and the planner's Layout all have them."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int


class Schedule(Sizes, Protocol):
    """Sizes with the pipeline's schedule (ParallelConfig, the planner's Layout)."""

    pp_schedule: str
    pp_microbatches: int | None
    pp_stages_per_rank: int


class ParallelSection(Schedule, Protocol):
    """The parallelism section of a job (parallel.config.ParallelConfig, which asks these rules itself:
    the rules name the shapes they read rather than import the config classes)."""

    auto: bool

    def model_dump(self) -> dict[str, Any]: ...

    @classmethod
    def model_validate(cls, obj: Any) -> Any: ...


class ModelShape(Protocol):
    """What the rules read of a model (parallel.config.ModelConfig)."""

    n_heads: int
    vocab_size: int
    n_layers: int
    max_seq_len: int
    moe: Any  # MoEConfig | None: num_experts, hidden_dim

    @property
    def kv_heads(self) -> int: ...

    @property
    def ffn_dim(self) -> int: ...


class TrainShape(Protocol):
    """What the rules read of the training setup (parallel.config.TrainConfig)."""

    seq_len: int
    global_batch_size: int


# --- arithmetic every caller shares ------------------------------------------------------------


def local_batch_size(global_batch_size: int, dp: int) -> int:
    """Sequences each dp rank runs per step (the last ranks pad with zero-weight samples)."""
    return math.ceil(global_batch_size / dp)


def model_parallel_size(p: Sizes) -> int:
    """Ranks per data-parallel replica: tp × pp × cp (ep borrows its ranks from dp_shard × cp)."""
    return p.tp * p.pp * p.cp


def stages_per_rank(schedule: str, pp: int, requested: int) -> int:
    """The stages each pp rank holds: looped schedules hold at least 2; zbv holds 2 when left at 1."""
    if pp <= 1:
        return requested
    if schedule in LOOPED_SCHEDULES:
        return max(requested, 2)
    if schedule in V_SCHEDULES and requested == 1:
        return 2
    return requested


_P = TypeVar("_P", bound=ParallelSection)


def layout_at_dp(parallel: _P, dp: int) -> _P:
    """This layout (a ParallelConfig) at data-parallel degree `dp`, as the runtime forms it: tp/pp/cp/ep
    stay; HSDP keeps its replicate degree when it divides dp, else the job runs plain FSDP over dp."""
    if parallel.dp_replicate > 1 and dp % parallel.dp_replicate == 0:
        rep, shard = parallel.dp_replicate, dp // parallel.dp_replicate
    else:
        rep, shard = 1, dp
    return type(parallel).model_validate({**parallel.model_dump(), "dp_replicate": rep, "dp_shard": shard})


def engine_at_dp(cfg: EngineConfig, dp: int) -> EngineConfig:
    """The engine config at data-parallel degree `dp` (a deep copy), its layout layout_at_dp's."""
    return cfg.model_copy(update={"parallelism": layout_at_dp(cfg.parallelism, dp)}, deep=True)


# --- the rules ------------------------------------------------------------------------------------


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def world_problems(p: Sizes, world: int) -> tuple[int | None, list[LayoutProblem]]:
    """The sizes against the world: (dp_shard with -1 filled, problems); dp_shard is None when it
    cannot be resolved."""
    problems = [
        LayoutProblem(f"parallelism.{name}", f"{name}={getattr(p, name)!r} must be a positive integer",
                      f"set parallelism.{name} to 1 or more")
        for name in ("dp_replicate", "cp", "tp", "pp", "ep") if not _positive(getattr(p, name))
    ]
    if not _positive(world):
        problems.append(LayoutProblem("world_size", f"world_size={world!r} must be a positive integer",
                                      "run at least one worker"))
    if p.dp_shard != -1 and not _positive(p.dp_shard):
        problems.append(LayoutProblem("parallelism.dp_shard",
                                      f"dp_shard={p.dp_shard!r} must be a positive integer or -1 (fill)",
                                      "use -1 to fill the world or a positive size"))
    if problems:
        return None, problems
    others = p.dp_replicate * p.cp * p.tp * p.pp
    if p.dp_shard == -1:
        if world % others:
            return None, [LayoutProblem(
                "parallelism", f"dp_replicate*cp*tp*pp={others} does not divide world_size={world}",
                "change the sizes or the number of workers (devices) so dp_shard=-1 can fill the world")]
        return world // others, []
    product = others * p.dp_shard
    if product != world:
        return p.dp_shard, [LayoutProblem(
            "parallelism",
            f"dp_replicate*dp_shard*cp*tp*pp={product} != world_size={world} (the sizes use {product} ranks "
            f"but the cluster has {world} devices or workers)",
            f"make the sizes multiply to {world} (or set dp_shard: -1 to fill it)")]
    return p.dp_shard, []


def ep_problems(dp_shard: int, cp: int, ep: int) -> list[LayoutProblem]:
    """Expert parallelism borrows its ranks from dp_shard × cp (as torchtitan), spanning all of cp."""
    if ep <= 1:
        return []
    problems = []
    if (dp_shard * cp) % ep:
        problems.append(LayoutProblem(
            "parallelism.ep", f"ep={ep} does not divide dp_shard*cp={dp_shard * cp}",
            "experts are sharded over part of dp_shard x cp (they borrow those ranks): pick an ep that "
            "divides it or raise dp_shard"))
    if ep % cp:
        problems.append(LayoutProblem("parallelism.ep", f"cp={cp} does not divide ep={ep}",
                                      "the ep group spans all of cp, so ep must be a multiple of cp"))
    return problems


def sequence_problems(model: ModelShape, train: TrainShape) -> list[LayoutProblem]:
    """What no layout at all can change: the sequence must fit the model's rope table."""
    if train.seq_len > model.max_seq_len:
        return [LayoutProblem("training.seq_len",
                              f"training.seq_len={train.seq_len} exceeds model.max_seq_len={model.max_seq_len}",
                              "raise model.max_seq_len or lower seq_len")]
    return []


def model_problems(model: ModelShape, train: TrainShape, *, tp: int, cp: int, ep: int, dp: int) -> list[LayoutProblem]:
    """Resolved sizes (dp = dp_replicate × dp_shard, filled) against the model and the training setup."""
    problems: list[LayoutProblem] = []
    if tp > 1:
        widths = [("n_heads", model.n_heads, ""), ("n_kv_heads", model.kv_heads, " (each tp rank holds whole kv heads)"),
                  ("ffn dim (hidden_dim)", model.ffn_dim, " (the MLP width)"), ("vocab_size", model.vocab_size, "")]
        if model.moe is not None and model.moe.hidden_dim is not None:
            widths.append(("moe.hidden_dim", model.moe.hidden_dim, " (the expert width)"))
        problems += [LayoutProblem("parallelism.tp", f"tp={tp} does not divide {name}={value}{why}",
                                   f"pick a tp that divides {value}")
                     for name, value, why in widths if value % tp]
    if cp > 1 and train.seq_len % (2 * cp):
        problems.append(LayoutProblem(
            "parallelism.cp", f"cp*2={2 * cp} does not divide training.seq_len={train.seq_len}",
            f"zigzag context parallelism cuts each sequence into 2·cp chunks: make seq_len a multiple of "
            f"{2 * cp} or change cp"))
    if ep > 1:
        if model.moe is None:
            problems.append(LayoutProblem("parallelism.ep",
                                          f"ep={ep} needs a mixture-of-experts model (MoE: model.moe)",
                                          "set ep: 1 or give the model a moe section"))
        elif model.moe.num_experts % ep:
            problems.append(LayoutProblem(
                "parallelism.ep", f"ep={ep} does not divide moe.num_experts={model.moe.num_experts}",
                "pick an ep that divides it"))
    if train.global_batch_size < dp:
        problems.append(LayoutProblem(
            "training.global_batch_size",
            f"training.global_batch_size={train.global_batch_size} is smaller than dp={dp}: some ranks would "
            f"train on padding only", "raise the batch or lower dp_replicate*dp_shard"))
    return problems + sequence_problems(model, train)


def schedule_problems(schedule: str, pp: int, stages: int) -> list[LayoutProblem]:
    """How many stages each pp rank holds under its schedule (pp > 1)."""
    if pp <= 1:
        return []
    if schedule in SINGLE_STAGE_SCHEDULES and stages != 1:
        return [LayoutProblem(
            "parallelism.pp_stages_per_rank",
            f"parallelism.pp_schedule={schedule} runs one stage per rank but pp_stages_per_rank={stages}",
            "set it to 1 or use interleaved_1f1b")]
    if schedule in V_SCHEDULES and stages != 2:
        return [LayoutProblem("parallelism.pp_stages_per_rank",
                              f"pp_schedule={schedule} uses exactly 2 stages per rank",
                              "set pp_stages_per_rank: 2")]
    if schedule in LOOPED_SCHEDULES and stages < 2:
        return [LayoutProblem("parallelism.pp_stages_per_rank",
                              f"parallelism.pp_schedule={schedule} interleaves stages and needs "
                              f"pp_stages_per_rank >= 2", "set pp_stages_per_rank: 2 or more")]
    return []


def stage_split_problems(n_layers: int, n_stages: int, split: Sequence[int] | None) -> list[LayoutProblem]:
    """The model's layers cut into pipeline stages: every stage needs a layer; a given split must fit."""
    problems: list[LayoutProblem] = []
    if n_layers < n_stages:
        problems.append(LayoutProblem(
            "parallelism.pp",
            f"pp stages={n_stages} exceed n_layers={n_layers}: model.n_layers={n_layers} is fewer than the "
            f"{n_stages} pipeline stages (pp × pp_stages_per_rank)",
            "lower pp or pp_stages_per_rank: every stage needs a layer"))
    if split is not None:
        split = list(split)
        if len(split) != n_stages:
            problems.append(LayoutProblem(
                "parallelism.pp_split",
                f"parallelism.pp_split has {len(split)} entries but there are {n_stages} stages "
                f"(pp × pp_stages_per_rank)", "give one layer count per stage"))
        if any(n < 1 for n in split):
            problems.append(LayoutProblem("parallelism.pp_split",
                                          f"parallelism.pp_split={split}: every stage needs at least one layer",
                                          "make every entry 1 or more"))
        if sum(split) != n_layers:
            problems.append(LayoutProblem(
                "parallelism.pp_split",
                f"parallelism.pp_split={split} sums to {sum(split)} but model.n_layers={n_layers}",
                "make them equal"))
    return problems


def microbatch_problems(pp: int, microbatches: int | None, local_batch: int | None) -> list[LayoutProblem]:
    """A pipeline cuts each rank's batch into equal micro-batches, at least one per stage rank."""
    if pp <= 1:
        return []
    m = microbatches or pp
    if m < pp:
        return [LayoutProblem("parallelism.pp_microbatches", f"parallelism.pp_microbatches={m} must be >= pp={pp}",
                              "raise pp_microbatches or lower pp")]
    if local_batch is not None and local_batch % m:
        return [LayoutProblem(
            "parallelism.pp_microbatches",
            f"the per-rank batch of {local_batch} sequences does not split into parallelism.pp_microbatches={m} "
            f"equal micro-batches", f"make global_batch_size/dp a multiple of {m} or change pp_microbatches")]
    return []


def pipeline_problems(pp: int, schedule: str, stages: int, microbatches: int | None, split: Sequence[int] | None,
                      model: ModelShape, local_batch: int | None) -> list[LayoutProblem]:
    """Every pipeline rule of one layout (nothing when pp = 1)."""
    if pp <= 1:
        return []
    return (schedule_problems(schedule, pp, stages) + stage_split_problems(model.n_layers, pp * stages, split)
            + microbatch_problems(pp, microbatches, local_batch))


def parallelism_problems(p: Schedule) -> list[LayoutProblem]:
    """The rules the parallelism section decides alone (ParallelConfig refuses these as it is parsed)."""
    problems: list[LayoutProblem] = []
    if p.dp_shard != -1 and not _positive(p.dp_shard):
        problems.append(LayoutProblem("parallelism.dp_shard",
                                      f"dp_shard={p.dp_shard!r} must be a positive integer or -1 (fill)",
                                      "use -1 to fill the world or a positive size"))
    if p.pp_microbatches is not None:
        problems += microbatch_problems(p.pp, p.pp_microbatches, None)
    if p.pp_schedule in V_SCHEDULES:
        problems += schedule_problems(p.pp_schedule, p.pp, p.pp_stages_per_rank)
    return problems


def layout_problems(p: Schedule, model: ModelShape, train: TrainShape, world: int) -> list[LayoutProblem]:
    """Every reason this layout cannot run `model` and `train` on `world` ranks (empty: it can)."""
    dp_shard, problems = world_problems(p, world)
    if dp_shard is None:
        return problems + sequence_problems(model, train)
    dp = p.dp_replicate * dp_shard
    problems += ep_problems(dp_shard, p.cp, p.ep) + model_problems(model, train, tp=p.tp, cp=p.cp, ep=p.ep, dp=dp)
    stages = p.pp_stages_per_rank if p.pp > 1 else 1
    return problems + pipeline_problems(p.pp, p.pp_schedule, stages, p.pp_microbatches, getattr(p, "pp_split", None),
                                        model, local_batch_size(train.global_batch_size, dp))


def dp_range_problems(p: Sizes, dp_min: int, dp_max: int | None) -> list[LayoutProblem]:
    """An elastic job's dp range (resources.dp) against its parallelism: a fixed dp_shard caps it, and
    an HSDP job starts as HSDP (its smallest dp is whole replicas; layout_at_dp for a later dp)."""
    problems: list[LayoutProblem] = []
    if p.dp_shard > 0:
        fixed = p.dp_replicate * p.dp_shard
        if dp_max is not None and dp_max > fixed:
            problems.append(LayoutProblem(
                "resources.dp.max", f"{dp_max} exceeds the parallelism's dp_replicate×dp_shard={fixed}",
                "lower it or set parallelism.dp_shard: -1"))
        if dp_min > fixed:
            problems.append(LayoutProblem(
                "resources.dp.min", f"{dp_min} exceeds the parallelism's dp_replicate×dp_shard={fixed}",
                "lower it or set parallelism.dp_shard: -1"))
    if p.dp_replicate > 1 and dp_min % p.dp_replicate:
        problems.append(LayoutProblem(
            "resources.dp.min", f"{dp_min} is not a multiple of parallelism.dp_replicate={p.dp_replicate}",
            "make it a multiple (whole replicas) or set dp_replicate: 1"))
    return problems


def fsdp_units(sizes: Sequence[float], min_size: float) -> list[range]:
    """Blocks `sizes` (parameter bytes each, in order) grouped into FSDP units of consecutive blocks:
    a unit closes once it holds `min_size`; a last one smaller than that joins the unit before it.
    Empty when the blocks would make a single unit: they are then left to the root's unit.
    `min_size` 0 gives one unit per block, whatever their number."""
    units: list[range] = []
    start, held = 0, 0.0
    for i, size in enumerate(sizes):
        held += size
        if held >= min_size:
            units.append(range(start, i + 1))
            start, held = i + 1, 0.0
    if start < len(sizes):  # the tail holds less than min_size
        tail = range(units.pop().start if units else start, len(sizes))
        units.append(tail)
    return units if len(units) > 1 or min_size <= 0 else []
