"""A concrete layout (every mesh size known), its batch geometry, and why it may be impossible.

Mesh order follows torchtitan: [pp, dp_replicate, dp_shard, cp, tp], tp innermost, so tp
groups are consecutive ranks (inside a node when they fit) and pp is outermost. FSDP shards
over dp_shard×cp flattened; expert parallelism borrows its ranks from that same group
(ep divides dp_shard·cp), as in torchtitan, so it does not multiply the world size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from parallel.config import ModelConfig, ParallelConfig, TrainConfig
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
            sequence_parallel=self.sequence_parallel,
        )
        if self.pp == 1:
            data["pp_microbatches"] = None
        return ParallelConfig.model_validate(data)

    def to_dict(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def layout_from_config(p: ParallelConfig, world: int) -> tuple[Layout | None, list[str]]:
    """Resolve dp_shard=-1 against the world size; (None, reasons) when the sizes cannot fill it."""
    fixed = p.dp_replicate * p.cp * p.tp * p.pp
    dp_shard = p.dp_shard
    if dp_shard == -1:
        if world % fixed:
            return None, [
                f"dp_replicate×cp×tp×pp = {p.dp_replicate}×{p.cp}×{p.tp}×{p.pp} = {fixed} does not divide "
                f"the {world} devices; pick sizes whose product divides {world}"
            ]
        dp_shard = world // fixed
    layout = Layout(
        dp_replicate=p.dp_replicate, dp_shard=dp_shard, cp=p.cp, tp=p.tp, pp=p.pp, ep=p.ep,
        zero_stage=p.zero_stage, pp_schedule=p.pp_schedule, pp_microbatches=p.pp_microbatches,
        pp_stages_per_rank=p.pp_stages_per_rank, sequence_parallel=p.sequence_parallel,
        cpu_offload=p.cpu_offload,
    )
    if layout.world != world:
        return None, [
            f"dp_replicate×dp_shard×cp×tp×pp = {p.dp_replicate}×{dp_shard}×{p.cp}×{p.tp}×{p.pp} = "
            f"{layout.world} but the cluster has {world} devices; make the product {world} "
            f"(or set dp_shard: -1 to fill it)"
        ]
    return layout, []


@dataclass(frozen=True)
class BatchShape:
    local_batch: int  # sequences per dp rank per step (padded up when dp does not divide the batch)
    micro_batch: int  # sequences per forward
    n_micro: int  # micro-batches per step per rank (pipeline: per stage)
    seq_local: int  # tokens of one sequence on one rank (seq_len/cp)
    padding: int  # padding sequences added across all dp ranks


def batch_shape(layout: Layout, train: TrainConfig) -> BatchShape:
    local = -(-train.global_batch_size // layout.dp)
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
    local = -(-train.global_batch_size // layout.dp)
    m = local
    v = layout.stages_per_rank
    if layout.pp_schedule in ("interleaved_1f1b", "zero_bubble") and v > 1:
        m -= m % layout.pp  # looped schedules step micro-batches in rounds of pp
    return replace(layout, pp_microbatches=max(m, layout.pp))


def request_reasons(model: ModelConfig, train: TrainConfig) -> list[str]:
    """Why no layout at all could run this model and training setup."""
    r: list[str] = []
    if train.seq_len > model.max_seq_len:
        r.append(f"training.seq_len={train.seq_len} exceeds model.max_seq_len={model.max_seq_len}; "
                 f"raise model.max_seq_len or lower seq_len")
    return r


def structural_reasons(layout: Layout, model: ModelConfig, train: TrainConfig) -> list[str]:
    """Why the engine could not run this layout at all (before memory)."""
    r: list[str] = request_reasons(model, train)
    t = layout.tp
    if t > 1:
        if model.n_heads % t:
            r.append(f"tp={t} does not divide n_heads={model.n_heads}; use a divisor of {model.n_heads}")
        if model.kv_heads % t:
            r.append(f"tp={t} does not divide the {model.kv_heads} kv heads (n_kv_heads); use a divisor of "
                     f"{model.kv_heads}")
        if model.ffn_dim % t:
            r.append(f"tp={t} does not divide the MLP width {model.ffn_dim}; use a divisor of it")
        if model.moe is not None and (model.moe.hidden_dim or model.ffn_dim) % t:
            r.append(f"tp={t} does not divide the expert width; use a divisor of it")
        if model.vocab_size % t:
            r.append(f"tp={t} does not divide vocab_size={model.vocab_size}; use a divisor of it")
    if layout.pp > 1:
        v = layout.stages_per_rank
        stages = layout.pp * v
        if stages > model.n_layers:
            r.append(f"pp={layout.pp} with {v} stage(s) per rank needs {stages} stages but the model has "
                     f"{model.n_layers} layers; lower pp or pp_stages_per_rank")
        m = layout.pp_microbatches or layout.pp
        local = -(-train.global_batch_size // layout.dp)
        if m < layout.pp:
            r.append(f"pp_microbatches={m} must be >= pp={layout.pp}")
        if local % m:
            r.append(f"the per-rank batch of {local} sequences does not split into pp_microbatches={m}; "
                     f"make global_batch_size/dp a multiple of {m} or change pp_microbatches")
        if layout.pp_schedule == "zbv" and v != 2:
            r.append("pp_schedule=zbv uses exactly 2 stages per rank; set pp_stages_per_rank: 2")
    if layout.cp > 1 and train.seq_len % (2 * layout.cp):
        r.append(f"cp={layout.cp} needs seq_len divisible by 2·cp={2 * layout.cp} (zigzag load balancing); "
                 f"seq_len is {train.seq_len}")
    if layout.ep > 1:
        if model.moe is None:
            r.append(f"ep={layout.ep} needs a MoE model (model.moe); set ep: 1")
        else:
            if model.moe.num_experts % layout.ep:
                r.append(f"ep={layout.ep} does not divide num_experts={model.moe.num_experts}; use a divisor")
            if layout.shard_group % layout.ep:
                r.append(f"ep={layout.ep} must divide dp_shard×cp={layout.shard_group} (experts borrow those "
                         f"ranks); raise dp_shard or lower ep")
            if layout.ep % layout.cp:
                r.append(f"ep={layout.ep} must be a multiple of cp={layout.cp} (the ep group spans all of cp)")
    if train.global_batch_size < layout.dp:
        r.append(f"global_batch_size={train.global_batch_size} is smaller than dp={layout.dp}: some ranks "
                 f"would train on padding only; raise global_batch_size or lower dp")
    return r


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
