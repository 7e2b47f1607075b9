"""A concrete layout (every mesh size known), its batch geometry, and why it may be impossible.

Mesh order follows torchtitan: [pp, dp_replicate, dp_shard, cp, tp], tp innermost, so tp
groups are consecutive ranks (inside a node when they fit) and pp is outermost. FSDP shards
over dp_shard×cp flattened; expert parallelism borrows its ranks from that same group
(ep divides dp_shard·cp), as in torchtitan, so it does not multiply the world size.
Whether a layout can run at all is the layout authority's to say (parallel/layout_rules.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from parallel.config import ModelConfig, ParallelConfig, TrainConfig
from parallel.layout_rules import (
    LOOPED_SCHEDULES,
    layout_problems,
    local_batch_size,
    sequence_problems,
    world_problems,
)
from parallel.planner.hardware import Cluster

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero_stage: int = 3
    pp_schedule: str = "1f1b"
    pp_microbatches: int | None = None
    pp_stages_per_rank: int = 1
    sequence_parallel: bool = True
    cpu_offload: bool = False
    fsdp_unit_mib: float = ParallelConfig.model_fields["fsdp_unit_mib"].default

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def shard_group(self) -> int:
        """Ranks that FSDP/ZeRO shards model states over (dp_shard×cp; HSDP replicates across dp_replicate)."""
        return self.dp_shard * self.cp

    @property
    def stages_per_rank(self) -> int:
        return self.pp_stages_per_rank if self.pp > 1 else 1

    def label(self) -> str:
        parts = [f"{k}={getattr(self, k)}" for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
                 if getattr(self, k) > 1]
        if self.pp > 1:
            parts.append(f"{self.pp_schedule}(m={self.pp_microbatches or self.pp}, v={self.stages_per_rank})")
        if self.shard_group > 1 and self.zero_stage != 3:
            parts.append(f"zero{self.zero_stage}")
        if self.cpu_offload:
            parts.append("offload")
        return " ".join(parts) or "single device"

    def to_parallel_config(self, base: ParallelConfig | None = None) -> ParallelConfig:
        """This layout as the engine's config, keeping base's other settings (auto cleared)."""
        base = base or ParallelConfig()
        data = base.model_dump()
        data.update(
            auto=False, dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, cp=self.cp, tp=self.tp,
            pp=self.pp, ep=self.ep, zero_stage=self.zero_stage, pp_schedule=self.pp_schedule,
            pp_microbatches=self.pp_microbatches if self.pp > 1 else base.pp_microbatches,
            pp_stages_per_rank=self.pp_stages_per_rank, cpu_offload=self.cpu_offload,
            sequence_parallel=self.sequence_parallel, fsdp_unit_mib=self.fsdp_unit_mib,
        )
        if self.pp == 1:
            data["pp_microbatches"] = None
        return ParallelConfig.model_validate(data)

    def to_dict(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def layout_from_config(p: ParallelConfig, world: int) -> tuple[Layout | None, list[str]]:
    """Resolve dp_shard=-1 against the world size; (None, reasons) when the sizes cannot fill it."""
    dp_shard, problems = world_problems(p, world)
    if dp_shard is None or problems:
        return None, [str(x) for x in problems]
    layout = Layout(
        dp_replicate=p.dp_replicate, dp_shard=dp_shard, cp=p.cp, tp=p.tp, pp=p.pp, ep=p.ep,
        zero_stage=p.zero_stage, pp_schedule=p.pp_schedule, pp_microbatches=p.pp_microbatches,
        pp_stages_per_rank=p.pp_stages_per_rank, sequence_parallel=p.sequence_parallel,
        cpu_offload=p.cpu_offload, fsdp_unit_mib=p.fsdp_unit_mib,
    )
    return layout, []


@dataclass(frozen=True)
class BatchShape:
    local_batch: int  # sequences per dp rank per step (padded up when dp does not divide the batch)
    micro_batch: int  # sequences per forward
    n_micro: int  # micro-batches per step per rank (pipeline: per stage)
    seq_local: int  # tokens of one sequence on one rank (seq_len/cp)
    padding: int  # padding sequences added across all dp ranks


def batch_shape(layout: Layout, train: TrainConfig) -> BatchShape:
    local = local_batch_size(train.global_batch_size, layout.dp)
    if layout.pp > 1:
        m = layout.pp_microbatches or layout.pp
        mb = -(-local // m)
    else:
        mb = min(train.micro_batch_size or local, local)
        m = -(-local // mb)
    return BatchShape(local_batch=local, micro_batch=mb, n_micro=m, seq_local=train.seq_len // layout.cp,
                      padding=local * layout.dp - train.global_batch_size)


def with_microbatches(layout: Layout, train: TrainConfig) -> Layout:
    """For a chosen pipeline layout without a set count: one sequence per micro-batch, the least bubble."""
    if layout.pp == 1 or layout.pp_microbatches is not None:
        return layout
    m = local_batch_size(train.global_batch_size, layout.dp)
    v = layout.stages_per_rank
    if layout.pp_schedule in LOOPED_SCHEDULES and v > 1:
        m -= m % layout.pp  # looped schedules step micro-batches in rounds of pp
    return replace(layout, pp_microbatches=max(m, layout.pp))


def request_reasons(model: ModelConfig, train: TrainConfig) -> list[str]:
    """Why no layout at all could run this model and training setup."""
    return [str(x) for x in sequence_problems(model, train)]


def structural_reasons(layout: Layout, model: ModelConfig, train: TrainConfig) -> list[str]:
    """Why the engine could not run this layout at all (before memory): the layout authority's verdict."""
    return [str(x) for x in layout_problems(layout, model, train, layout.world)]


def group_stride(layout: Layout, dim: str) -> tuple[int, int]:
    """(size, stride in ranks) of one mesh dimension's groups; 'fsdp' and 'ep' are the flattened ones."""
    if dim == "tp":
        return layout.tp, 1
    if dim == "cp":
        return layout.cp, layout.tp
    if dim == "dp_shard":
        return layout.dp_shard, layout.tp * layout.cp
    if dim == "fsdp":
        return layout.shard_group, layout.tp
    if dim == "ep":
        return layout.ep, layout.tp
    if dim == "dp_replicate":
        return layout.dp_replicate, layout.tp * layout.cp * layout.dp_shard
    if dim == "pp":
        return layout.pp, layout.world // layout.pp
    raise ValueError(f"unknown mesh dim {dim!r}")


def spans_nodes(layout: Layout, dim: str, cluster: Cluster) -> bool:
    size, stride = group_stride(layout, dim)
    nodes = {(j * stride) // cluster.devices_per_node for j in range(size)}
    return len(nodes) > 1
