"""Time per step of one layout: compute at an assumed MFU, pipeline bubble, exposed communication.

step = compute·(1 + bubble) + (Σ comm − min(Σ overlap_i·comm_i, compute)) + optimizer + dispatch

- compute: FLOPs per token (6·N + attention, plus recomputation) × the rank's tokens ÷ (tp·pp)
  ÷ (peak × MFU). The rank's tokens count the padding when dp does not divide the batch.
- bubble: (p−1)/m for GPipe and 1F1B, (p−1)/(v·m) interleaved; zero-bubble schedules split the
  backward and fill most of it: a third of the interleaved figure (Qi et al. 2023, ZB-H1).
- optimizer: AdamW is bound by memory bandwidth: ~32 bytes read+written per local parameter.
- dispatch: per-layer op launch cost not hidden behind the device (zero on GPUs, real on CPU).
On CPU ranks beyond the core count share cores, so each gets cores/ranks of the per-core peak.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from parallel.config import ModelConfig, TrainConfig
from parallel.layout_rules import SINGLE_STAGE_SCHEDULES
from parallel.planner.comm import CommTerm, estimate_comm
from parallel.planner.flops import flops_per_token_term, recompute_flops_per_token
from parallel.planner.hardware import Cluster
from parallel.planner.layout import Layout, batch_shape
from parallel.planner.memory import rank_params
from parallel.planner.terms import Term, fmt_time, g, total

ZERO_BUBBLE_SCHEDULES = ("zero_bubble", "zbv")


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle time of a pipeline step over its compute (the one formula; parallel/pp.py has none).

    (p−1)/m for gpipe/1f1b and (p−1)/(v·m) interleaved (Narayanan et al. 2021). The zero-bubble
    schedules split the backward into input-gradient (B) and weight-gradient (W) work and put W in
    the bubbles: ZB-H1's bubble is (p−1)(T_F+T_B−T_W) against 1F1B's (p−1)(T_F+T_B+T_W), a third of
    it when T_F = T_B = T_W (Qi et al. 2023). torch's own schedule tables agree exactly: counting the
    idle slots of ScheduleInterleavedZeroBubble and ScheduleZBVZeroBubble's `pipeline_order` (one
    slot per F, B or W) gives (p−1)/(3·v·m) (tests/parallel/test_pipeline_bubble.py checks it).
    """
    if p <= 1:
        return 0.0
    if schedule in SINGLE_STAGE_SCHEDULES:
        return (p - 1) / m
    frac = (p - 1) / (v * m)
    if schedule in ZERO_BUBBLE_SCHEDULES:
        frac /= 3
    return frac


@dataclass
class TimeEstimate:
    compute: Term
    bubble: Term
    comm: list[CommTerm]
    hidden: Term  # communication hidden behind compute (subtracted)
    optimizer: Term
    dispatch: Term
    tokens_per_step: int
    flops_per_token: Term
    peak_flops: float
    world: int
    notes: list[str] = field(default_factory=list)

    @property
    def comm_total(self) -> float:
        return total([c.term for c in self.comm])

    @property
    def exposed_comm(self) -> float:
        return self.comm_total + self.hidden.value  # hidden is stored negative

    @property
    def step_time(self) -> float:
        return self.compute.value + self.bubble.value + self.exposed_comm + self.optimizer.value + self.dispatch.value

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time

    @property
    def mfu(self) -> float:
        return self.flops_per_token.value * self.tokens_per_s / (self.world * self.peak_flops)

    def terms(self) -> list[Term]:
        return [self.compute, self.bubble, *(c.term for c in self.comm), self.hidden, self.optimizer, self.dispatch]

    def to_dict(self) -> dict[str, object]:
        return {
            "step_time_s": self.step_time, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
            "compute_s": self.compute.value, "bubble_s": self.bubble.value, "comm_s": self.comm_total,
            "exposed_comm_s": self.exposed_comm, "optimizer_s": self.optimizer.value,
            "dispatch_s": self.dispatch.value, "terms": [t.to_dict() for t in self.terms()],
            "comm": [{"name": c.term.name, "seconds": c.term.value, "bytes": c.volume, "calls": c.calls,
                      "inter_node": c.inter_node, "overlap": c.overlap} for c in self.comm],
            "notes": self.notes,
        }


def estimate_time(model: ModelConfig, train: TrainConfig, layout: Layout, cluster: Cluster) -> TimeEstimate:
    hw = cluster.hardware
    bs = batch_shape(layout, train)
    fpt = flops_per_token_term(model, train.seq_len)
    rec = recompute_flops_per_token(model, train.seq_len, train.activation_checkpointing)
    rank_tokens = bs.local_batch * train.seq_len / layout.cp
    split = layout.tp * layout.pp
    peak = hw.peak_flops[train.dtype]
    share = 1.0
    notes: list[str] = []
    if hw.cores_per_node is not None and cluster.devices_per_node > hw.cores_per_node:
        share = hw.cores_per_node / cluster.devices_per_node
        notes.append(f"{cluster.devices_per_node} ranks share {hw.cores_per_node} cores: each gets {share:.2f}")
    rate = peak * hw.mfu * share
    flops = (fpt.value + rec.value) * rank_tokens / split
    compute = Term("compute", flops / rate, "(F_tok + F_recompute)·tokens_rank/(tp·pp) / (peak·MFU)",
                   f"({g(fpt.value)} + {g(rec.value)}) × {g(rank_tokens)} / {split} / "
                   f"({g(peak)} × {hw.mfu}" + (f" × {share:.2f}" if share < 1 else "") + ")")
    frac = bubble_fraction(layout.pp_schedule, layout.pp, bs.n_micro, layout.stages_per_rank)
    bubble = Term("pipeline bubble", compute.value * frac, "compute × bubble fraction",
                  f"{fmt_time(compute.value)} × {frac:.3f}"
                  + (f" [(p−1)/(v·m) = {layout.pp - 1}/({layout.stages_per_rank}·{bs.n_micro})"
                     + (" / 3" if layout.pp_schedule in ZERO_BUBBLE_SCHEDULES else "") + "]"
                     if layout.pp > 1 else ""))
    comm = estimate_comm(model, train, layout, cluster)
    overlappable = sum(c.overlap * c.term.value for c in comm)
    hidden_v = min(overlappable, compute.value)
    hidden = Term("hidden by overlap", -hidden_v, "−min(Σ overlap_i·comm_i, compute)",
                  f"−min({fmt_time(overlappable)}, {fmt_time(compute.value)})")
    rp = rank_params(model, layout, "first")
    local = (rp.dense + rp.experts) / (layout.shard_group if layout.zero_stage >= 1 else 1)
    mem_bw = hw.mem_bw * share
    optimizer = Term("optimizer step", local * 32 / mem_bw, "Ψ_local·32 B / memory bandwidth",
                     f"{g(local)} × 32 / {g(mem_bw / 1e9)} GB/s")
    launches = rp.layers * bs.n_micro * (2 if train.activation_checkpointing == "full" else 1)
    dispatch = Term("op dispatch", launches * hw.layer_overhead_s / share if hw.layer_overhead_s else 0.0,
                    "layers·micro-batches × per-layer launch cost",
                    f"{launches} × {g(hw.layer_overhead_s * 1e3)} ms")
    return TimeEstimate(compute=compute, bubble=bubble, comm=comm, hidden=hidden, optimizer=optimizer,
                        dispatch=dispatch, tokens_per_step=train.global_batch_size * train.seq_len,
                        flops_per_token=fpt, peak_flops=peak, world=layout.world, notes=notes)
