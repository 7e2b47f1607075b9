"""Communication per step of one layout: collective volumes on the bandwidth tier each lands on.

Ring volumes per rank for a payload of S bytes over n ranks: all-reduce 2(n−1)/n·S, all-gather
and reduce-scatter (n−1)/n·S, all-to-all (n−1)/n·S. Time = volume / bandwidth + calls × latency
(the alpha-beta model); a group inside one node uses NVLink, one that spans nodes the network.

Per strategy:
- FSDP (ZeRO-3): all-gather the weights in forward and again in backward of each micro-batch,
  reduce-scatter the gradients: 3Ψ per step with one micro-batch. ZeRO-1/2: one all-gather per
  micro-batch; ZeRO-1 reduces gradients once a step. Pipeline stages keep weights gathered.
- HSDP / DDP: all-reduce of the (sharded) gradients across dp_replicate.
- TP (+SP): 4 all-reduce-sized collectives of b·s·h activations per layer per micro-batch
  (2 forward, 2 backward; SP's all-gather + reduce-scatter pairs move the same bytes); full AC
  reruns the forward's 2.
- PP: each micro-batch sends b·s·h activations forward and their gradients back per stage boundary.
- CP (ring attention): cp−1 K/V passes forward, K/V + dK/dV passes backward, per layer.
- EP: dispatch and combine all-to-alls of top_k·b·s·h in forward and backward, per MoE layer.
`OVERLAP` is the share of each that runs behind compute (FSDP prefetch, async P2P, ring attention
overlapping block compute); TP and EP sit on the critical path (no async TP).
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel.config import ModelConfig, TrainConfig
from parallel.planner.hardware import Cluster
from parallel.planner.layout import Layout, batch_shape, spans_nodes
from parallel.planner.memory import ACT_BYTES, rank_params
from parallel.planner.terms import Term, fmt_bytes, g

OVERLAP = {"fsdp": 0.8, "dp_replicate": 0.8, "tp": 0.0, "pp": 0.5, "cp": 0.7, "ep": 0.0}


def all_reduce_volume(size: float, n: int) -> float:
    return 2 * (n - 1) / n * size if n > 1 else 0.0


def all_gather_volume(size: float, n: int) -> float:
    """Also reduce-scatter's and all-to-all's: each rank sends and receives (n−1)/n of S."""
    return (n - 1) / n * size if n > 1 else 0.0


reduce_scatter_volume = all_gather_volume
all_to_all_volume = all_gather_volume


@dataclass(frozen=True)
class CommTerm:
    term: Term  # seconds per step
    strategy: str  # key of OVERLAP
    volume: float  # bytes per rank per step
    calls: int
    inter_node: bool

    overlap_scale: float = 1.0  # the hardware's: 0 where collectives take the cores compute needs

    @property
    def overlap(self) -> float:
        return OVERLAP[self.strategy] * self.overlap_scale


def _tier(cluster: Cluster, inter: bool) -> tuple[float, float, str]:
    hw = cluster.hardware
    if inter:
        return hw.inter_bw, hw.inter_latency_s, "inter-node"
    return hw.intra_bw, hw.intra_latency_s, "intra-node"


def _term(name: str, strategy: str, volume: float, calls: int, cluster: Cluster, inter: bool,
          formula: str, filled: str, kind: str = "all_reduce") -> CommTerm:
    bw, lat, tier = _tier(cluster, inter)
    eff = cluster.hardware.collective_efficiency.get(kind, 1.0)
    bw *= eff
    if eff != 1.0:
        tier += f", {kind} at {eff:g}× the all-reduce rate"
    secs = volume / bw + calls * lat
    return CommTerm(
        Term(name, secs, f"{formula} / bw + calls·α",
             f"{filled} = {fmt_bytes(volume)} / {g(bw / 1e9)} GB/s ({tier}) + {calls} × {g(lat * 1e6)} µs"),
        strategy, volume, calls, inter, cluster.hardware.overlap_scale)


def estimate_comm(model: ModelConfig, train: TrainConfig, layout: Layout, cluster: Cluster) -> list[CommTerm]:
    bs = batch_shape(layout, train)
    ab = ACT_BYTES[train.dtype]
    wb = ab  # weights are gathered in the compute dtype
    gb = 4  # gradients are reduced in fp32 ("bf16 compute, fp32 reduce")
    rp = rank_params(model, layout, "first")
    psi = rp.dense + rp.experts
    m, v = bs.n_micro, layout.stages_per_rank
    out: list[CommTerm] = []

    n = layout.shard_group
    r = layout.dp_replicate
    # FSDP2 as the engine applies it (parallel/fsdp.py): ZeRO-3 gathers each unit (blocks grouped by
    # layout_rules.fsdp_units, and the root) for forward and again for backward; ZeRO-1/2 gather once
    # per micro-batch (no reshard after forward); gradients are reduce-scattered every micro-batch
    # except under ZeRO-1 (once a step). Pipeline stages keep their weights gathered through the step.
    stage = layout.zero_stage
    syncs = 1 if stage == 1 else m
    if n > 1:
        inter = spans_nodes(layout, "fsdp", cluster)
        gathers = 1 if layout.pp > 1 else (2 * m if stage == 3 else m)
        vol = gathers * all_gather_volume(psi * wb, n)
        out.append(_term(f"FSDP (ZeRO-{stage}) all-gather", "fsdp", vol, gathers * rp.fsdp_units, cluster, inter,
                         "gathers·Ψ·w·(N−1)/N", f"{gathers} × {g(psi)} × {wb} × {n - 1}/{n}", "all_gather"))
        vol = syncs * reduce_scatter_volume(psi * gb, n)
        out.append(_term(f"FSDP (ZeRO-{stage}) reduce-scatter", "fsdp", vol, syncs * rp.fsdp_units, cluster, inter,
                         "syncs·Ψ·4·(N−1)/N", f"{syncs} × {g(psi)} × 4 × {n - 1}/{n}", "reduce_scatter"))
    if r > 1:
        inter = spans_nodes(layout, "dp_replicate", cluster)
        shard = psi / n
        vol = syncs * all_reduce_volume(shard * gb, r)
        out.append(_term("gradient all-reduce (dp_replicate)", "dp_replicate", vol, syncs * rp.fsdp_units, cluster,
                         inter, "syncs·2·(Ψ/N)·4·(R−1)/R", f"{syncs} × 2 × {g(shard)} × 4 × {r - 1}/{r}"))
    t = layout.tp
    if t > 1:
        inter = spans_nodes(layout, "tp", cluster)
        act = bs.micro_batch * bs.seq_local * model.dim * ab
        per_layer = 6 if train.activation_checkpointing == "full" else 4
        calls = per_layer * rp.layers * m
        if layout.sequence_parallel:
            # SP: each all-reduce becomes an all-gather + a reduce-scatter of the same bytes.
            for kind in ("all_gather", "reduce_scatter"):
                vol = calls * all_gather_volume(act, t)
                out.append(_term(f"TP activation {kind.replace('_', '-')}s", "tp", vol, calls, cluster, inter,
                                 "k·L·m·(b·s·h·bytes)·(t−1)/t",
                                 f"{per_layer} × {rp.layers} × {m} × {fmt_bytes(act)} × {t - 1}/{t}", kind))
        else:
            vol = calls * all_reduce_volume(act, t)
            out.append(_term("TP activation all-reduces", "tp", vol, calls, cluster, inter,
                             "k·L·m·2·(b·s·h·bytes)·(t−1)/t",
                             f"{per_layer} × {rp.layers} × {m} × 2 × {fmt_bytes(act)} × {t - 1}/{t}"))
    p = layout.pp
    if p > 1:
        inter = spans_nodes(layout, "pp", cluster)
        act = bs.micro_batch * bs.seq_local * model.dim * ab / (t if layout.sequence_parallel else 1)
        calls = 2 * m * v
        vol = calls * act
        out.append(_term("PP send/recv", "pp", vol, calls, cluster, inter, "2·m·v·(b·s·h·bytes)",
                         f"2 × {m} × {v} × {fmt_bytes(act)}", "p2p"))
    c = layout.cp
    if c > 1:
        inter = spans_nodes(layout, "cp", cluster)
        kv = bs.micro_batch * bs.seq_local * model.kv_heads * model.head_dim / t * ab
        passes = 6 * (c - 1)  # forward: K and V; backward: K, V, dK, dV
        calls = passes * rp.layers * m
        vol = calls * kv
        out.append(_term("CP ring K/V passes", "cp", vol, calls, cluster, inter,
                         "6·(cp−1)·L·m·(b·(s/cp)·kv·Q/t·bytes)",
                         f"6 × {c - 1} × {rp.layers} × {m} × {fmt_bytes(kv)}", "p2p"))
    e = layout.ep
    if e > 1 and rp.moe_layers:
        inter = spans_nodes(layout, "ep", cluster)
        tok = bs.micro_batch * bs.seq_local * model.moe.top_k * model.dim * ab / t
        calls = 4 * rp.moe_layers * m
        vol = calls * all_to_all_volume(tok, e)
        out.append(_term("EP all-to-all", "ep", vol, calls, cluster, inter,
                         "4·L_moe·m·(k·b·s·h·bytes)·(ep−1)/ep",
                         f"4 × {rp.moe_layers} × {m} × {fmt_bytes(tok)} × {e - 1}/{e}", "all_to_all"))
    return out
