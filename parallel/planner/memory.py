"""Peak memory per device of one layout, itemised.

Model states (ZeRO paper accounting, Rajbhandari et al. 2020): AdamW keeps per parameter
2+2+12 bytes in mixed precision (bf16 weights and grads; fp32 master weights, momentum and
variance) and 4+4+8 bytes in fp32. ZeRO-1 shards the optimizer states over the shard group
(N = dp_shard·cp; HSDP replicates across dp_replicate), ZeRO-2 the gradients too, ZeRO-3
(FSDP) everything: 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N. TP and PP divide Ψ first; EP divides the
experts, which FSDP then shards over N/ep.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation"): per layer per
micro-batch sbh(34 + 5as/h) bytes at 16 bits; with TP and sequence parallelism all of it is
divided by t, without SP only 24 of the 34. Selective recomputation drops the 5as/h
(attention scores) term; full recomputation keeps each layer's input (2sbh) plus one layer's
worth while it is recomputed. The engine's attention is fused SDPA, which never stores the
s×s scores, so the planner drops the 5as/h term unless asked to keep it. fp32 doubles it all.
Sequence lengths are per rank (s/cp under context parallelism).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from parallel.config import ModelConfig, TrainConfig
from parallel.layout_rules import fsdp_units
from parallel.planner.hardware import Cluster
from parallel.planner.layout import Layout, batch_shape
from parallel.planner.params import count_params
from parallel.planner.terms import Term, fmt_bytes, g, total

# Bytes per parameter of (weights, gradients, optimizer states) under AdamW.
STATE_BYTES = {"bfloat16": (2, 2, 12), "float32": (4, 4, 8)}
ACT_BYTES = {"bfloat16": 2, "float32": 4}
MASTER_BYTES = 4  # the engine keeps fp32 parameters (bf16 is FSDP's compute copy): what its units count


def model_state_bytes(psi: float, n: int, stage: int, dtype: str = "bfloat16") -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes per device for Ψ parameters under ZeRO-`stage` over n ranks."""
    w, gr, o = STATE_BYTES[dtype]
    if stage >= 1:
        o = o / n
    if stage >= 2:
        gr = gr / n
    if stage >= 3:
        w = w / n
    return w * psi, gr * psi, o * psi


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = True,
                            recompute: str = "none", scores_stored: bool = True) -> float:
    """Activation bytes of one transformer layer for one micro-batch at 16 bits (the paper's Table 2)."""
    scores = 5 * a * s / h if scores_stored else 0.0
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    if recompute == "selective":
        scores = 0.0
    if sp:
        return s * b * h * (34 + scores) / t
    return s * b * h * (10 + 24 / t + scores / t)


def inflight_microbatches(layout: Layout, n_micro: int) -> tuple[float, float]:
    """Micro-batches whose activations the (first, last) pipeline rank holds at its peak."""
    p, m, v = layout.pp, n_micro, layout.stages_per_rank
    if p == 1:
        return 1.0, 1.0
    if layout.pp_schedule == "gpipe":
        return float(m), float(m)
    first = float(min(p, m))
    if v > 1 and layout.pp_schedule in ("interleaved_1f1b", "zero_bubble"):
        first *= 1 + (p - 1) / (p * v)  # Megatron's interleaved schedule keeps this much more
    return first, 1.0


@dataclass
class MemoryEstimate:
    persistent: list[Term]  # held all step: weights, grads, optimizer states, framework
    fwd_bwd: list[Term]  # transient peak of forward/backward
    optimizer_step: list[Term]  # transient peak of the optimizer step
    host: list[Term]  # CPU offload: per device, in host memory
    capacity: float  # usable bytes per device
    host_capacity: float
    rank: str  # which pipeline rank is the worst ("first", "last", "only")
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> float:
        return total(self.persistent) + max(total(self.fwd_bwd), total(self.optimizer_step))

    @property
    def host_total(self) -> float:
        return total(self.host)

    def item(self, name: str) -> float:
        return sum(t.value for t in self.persistent + self.fwd_bwd + self.optimizer_step if t.name == name)

    def to_dict(self) -> dict[str, object]:
        return {
            "peak_bytes": self.peak, "capacity_bytes": self.capacity, "rank": self.rank,
            "persistent": [t.to_dict() for t in self.persistent],
            "fwd_bwd": [t.to_dict() for t in self.fwd_bwd],
            "optimizer_step": [t.to_dict() for t in self.optimizer_step],
            "host": [t.to_dict() for t in self.host], "host_bytes": self.host_total,
            "host_capacity_bytes": self.host_capacity, "notes": self.notes,
        }


def engine_layer_units(model: ModelConfig, t: int, sp: bool, moe_layer: bool,
                       dtype: str = "float32") -> tuple[float, float]:
    """Tensors autograd keeps for one block of parallel/model.py, in s·b·h elements:
    (held whole on each tp rank, divided by t). Counted from the block's code (and checked with
    saved_tensors_hooks on the `small` preset: 21.3 measured vs 21 here):
    the block input and the residual (RMSNorm inputs) 2; the two norm outputs the linears keep 2;
    q after RoPE, k and v expanded to all heads (repeat_interleave), the attention output and the
    wo input 5; RoPE temporaries 1; SwiGLU's w1 and w3 outputs, silu output and product 4·f/h.
    A MoE layer runs the SwiGLU part per chosen expert and keeps the permuted tokens (2 per choice).
    Under DTensor TP with sequence parallelism the norm outputs are all-gathered before the
    colwise linears and kept whole; without SP the norms run on whole sequences. In bf16 the
    RMSNorms compute in fp32 and keep fp32 copies of their input and normalised value: 4 more
    bf16-sized units (25.1 measured vs 25 here)."""
    h = model.dim
    norms = 4.0 if dtype == "bfloat16" else 0.0
    if moe_layer and model.moe is not None:
        k = model.moe.top_k
        mlp = 4 * (model.moe.hidden_dim or model.ffn_dim) / h * k + 2 * k
    else:
        mlp = 4 * model.ffn_dim / h
    if t == 1:
        return 0.0, 10 + norms + mlp
    if sp:
        return 2.0, 8 + norms + mlp
    return 4.0 + norms, 6 + mlp


def activation_terms(model: ModelConfig, train: TrainConfig, rp: RankParams, s: int, b: int, t: int, sp: bool,
                     inflight: float, activation_model: str, scores_stored: bool) -> list[Term]:
    """Stored activations of the rank's layers for the in-flight micro-batches, plus the working set
    of the layer being back-propagated (its activation gradients; with AC also its recomputed forward)."""
    ab = ACT_BYTES[train.dtype]
    ac = train.activation_checkpointing
    sbh = s * b * model.dim
    dense_layers = rp.layers - rp.moe_layers
    tt = t if sp else 1
    if ac == "full":
        n_ckpt = rp.layers
    elif ac == "selective":
        n_ckpt = (rp.layers + 1) // 2  # the engine checkpoints every other block (ids 0, 2, 4, ...)
    else:
        n_ckpt = 0
    kept_input = sbh / tt * ab  # a checkpointed block keeps only its input
    if activation_model == "korthikanti":
        per = korthikanti_layer_bytes(s, b, model.dim, model.n_heads, t, sp, "none", scores_stored) * ab / 2
        per_dense = per_moe = per
        if rp.moe_layers and model.moe is not None:
            widen = (model.moe.hidden_dim or model.ffn_dim) / model.ffn_dim
            per_moe = per + 19 * sbh * (model.moe.top_k * widen - 1) / tt * ab / 2  # the MLP's 19sbh per expert
        coef = "34" + (" + 5as/h" if scores_stored else "")
        formula = f"sbh({coef})/t × (bytes/2) per kept layer"
        unit_txt = f"{s}·{b}·{model.dim}·({coef}) / {tt} × {ab / 2:g}"
    else:
        full_d, shard_d = engine_layer_units(model, t, sp, False, train.dtype)
        full_m, shard_m = engine_layer_units(model, t, sp, True, train.dtype)
        per_dense = (full_d + shard_d / t) * sbh * ab
        per_moe = (full_m + shard_m / t) * sbh * ab
        formula = "s·b·h·(whole + split/t)·bytes per kept layer (this engine's saved tensors)"
        unit_txt = f"{s}·{b}·{model.dim}·({g(full_d)} + {g(shard_d)}/{t}) × {ab}"
    # Checkpointed blocks are spread like the others; keep the MoE share proportional.
    kept = rp.layers - n_ckpt
    kept_moe = round(kept * rp.moe_layers / rp.layers) if rp.layers else 0
    stored = (kept_moe * per_moe + (kept - kept_moe) * per_dense + n_ckpt * kept_input) * inflight
    ac_txt = f", {n_ckpt} checkpointed (input only: s·b·h/t·bytes)" if n_ckpt else ""
    moe_txt = f" ({rp.moe_layers} MoE, top_k={model.moe.top_k})" if rp.moe_layers and model.moe else ""
    terms = [Term(
        "activations", stored, formula + " × kept layers × in-flight",
        f"{unit_txt} × {kept} kept layers{moe_txt}{ac_txt} × {inflight:g} in flight",
    )]
    biggest = per_moe if rp.moe_layers else per_dense
    if dense_layers == 0 and not rp.moe_layers:
        biggest = 0.0
    terms.append(Term("backward working set", biggest, "one layer's activations (its gradients in backward)",
                      unit_txt))
    if n_ckpt:
        terms.append(Term("recompute (one layer)", biggest, "one checkpointed layer re-run in backward", unit_txt))
    return terms


@dataclass(frozen=True)
class RankParams:
    dense: float  # local (after tp) parameters sharded over the FSDP group
    experts: float  # local (after ep, tp) expert parameters sharded over N/ep
    layers: int  # transformer layers on this rank
    moe_layers: int
    has_embedding: bool
    has_output: bool
    largest_unit: float  # local params of the biggest FSDP unit before sharding (layout_rules.fsdp_units)
    fsdp_units: int  # FSDP units on this rank, the root's included: one all-gather and reduce-scatter each


def rank_params(model: ModelConfig, layout: Layout, which: str) -> RankParams:
    """Parameters a pipeline rank holds. 'first' has the embedding, 'last' the norm and output
    (zbv's V shape puts both on the first rank); the layer count is the worst rank's."""
    pc = count_params(model)
    stages = layout.pp * layout.stages_per_rank
    layers = math.ceil(model.n_layers / stages) * layout.stages_per_rank if layout.pp > 1 else model.n_layers
    layers = min(layers, model.n_layers)
    moe_layers = math.ceil(layers * pc.n_moe_layers / model.n_layers) if pc.n_moe_layers else 0
    dense_layers = layers - moe_layers
    only = layout.pp == 1
    zbv = layout.pp_schedule == "zbv"
    has_emb = only or which == "first"
    has_out = only or which == "last" or (zbv and which == "first")
    t = layout.tp
    dense = dense_layers * pc.layer_dense + moe_layers * pc.layer_moe_shared
    if has_emb:
        dense += pc.embedding
    if has_out:
        dense += pc.output + pc.final_norm
    experts = moe_layers * pc.experts_per_layer / (layout.ep * t)
    moe_size = pc.layer_moe_shared + pc.experts_per_layer / layout.ep
    sizes = [(moe_size if model.is_moe_layer(i) else pc.layer_dense) / t for i in range(layers)]
    units = fsdp_units([s * MASTER_BYTES for s in sizes], layout.fsdp_unit_mib * 2**20)
    # Blocks in no unit are the root's: then the model is one unit, gathered whole.
    unit = max((sum(sizes[i] for i in u) for u in units), default=dense / t + experts)
    return RankParams(dense=dense / t, experts=experts, layers=layers, moe_layers=moe_layers,
                      has_embedding=has_emb, has_output=has_out, largest_unit=unit, fsdp_units=len(units) + 1)


def estimate_memory(model: ModelConfig, train: TrainConfig, layout: Layout, cluster: Cluster,
                    activation_model: str = "engine", scores_stored: bool = False) -> MemoryEstimate:
    """The worst rank's peak; pipeline first and last ranks are both computed.

    activation_model: "engine" counts the tensors parallel/model.py's block keeps for backward
    (the default: it is what runs); "korthikanti" uses the paper's GPT-layer formula."""
    if activation_model not in ("engine", "korthikanti"):
        raise ValueError(f"activation_model={activation_model!r}; use engine or korthikanti")
    whiches = ["only"] if layout.pp == 1 else ["first", "last"]
    ests = [_estimate_rank(model, train, layout, cluster, w, activation_model, scores_stored) for w in whiches]
    return max(ests, key=lambda e: e.peak)


def _estimate_rank(model: ModelConfig, train: TrainConfig, layout: Layout, cluster: Cluster, which: str,
                   activation_model: str, scores_stored: bool) -> MemoryEstimate:
    hw = cluster.hardware
    dtype = train.dtype
    rp = rank_params(model, layout, which if which != "only" else "first")
    bs = batch_shape(layout, train)
    n = layout.shard_group
    n_e = max(1, n // layout.ep)
    stage = layout.zero_stage if n > 1 else 0
    wb, gb, ob = STATE_BYTES[dtype]
    w_d, g_d, o_d = model_state_bytes(rp.dense, n, stage, dtype)
    w_e, g_e, o_e = model_state_bytes(rp.experts, n_e, stage if n_e > 1 else 0, dtype)
    psi = rp.dense + rp.experts
    div = {0: (1, 1, 1), 1: (1, 1, n), 2: (1, n, n), 3: (n, n, n)}[stage]
    sym = {0: ("", "", ""), 1: ("", "", "/N"), 2: ("", "/N", "/N"), 3: ("/N", "/N", "/N")}[stage]
    ep_note = f" (+ {g(rp.experts)} expert params over N/ep={n_e})" if rp.experts else ""
    psi_txt = f"Ψ={g(rp.dense)}{ep_note}, N={n}"

    def state(name: str, b: int, d: int, s: str, v: float) -> Term:
        return Term(name, v, f"{b}·Ψ{s}", f"{b} × {g(rp.dense)} / {d}{ep_note} [{psi_txt}]")

    weights = state("parameters", wb, div[0], sym[0], w_d + w_e)
    grads = state("gradients", gb, div[1], sym[1], g_d + g_e)
    optim = state("optimizer states", ob, div[2], sym[2], o_d + o_e)
    persistent: list[Term] = []
    host: list[Term] = []
    notes: list[str] = []
    if layout.cpu_offload:
        # FSDP's CPU offload keeps the sharded weights, gradients and optimizer states in host
        # memory (the optimizer steps there); ZeRO-1/2 offload moves the optimizer states only.
        moved = [weights, grads, optim] if stage == 3 or n == 1 else [optim]
        host.extend(moved)
        persistent.extend(t for t in (weights, grads, optim) if t not in moved)
        notes.append("cpu_offload: " + ", ".join(t.name for t in moved) + " live in host memory")
    else:
        persistent.extend([weights, grads, optim])
    persistent.append(Term("framework", hw.framework_bytes, "runtime baseline",
                           f"{fmt_bytes(hw.framework_bytes)} ({hw.name} preset: "
                           + ("CUDA context, NCCL buffers" if hw.mem_bytes else "process RSS with torch + gloo")
                           + ")"))

    # Activations.
    ab = ACT_BYTES[dtype]
    s, b, t = bs.seq_local, bs.micro_batch, layout.tp
    sp = layout.sequence_parallel or t == 1
    first_inflight, last_inflight = inflight_microbatches(layout, bs.n_micro)
    inflight = first_inflight if which in ("first", "only") else last_inflight
    fwd_bwd = activation_terms(model, train, rp, s, b, t, sp, inflight, activation_model, scores_stored)
    if rp.has_output:
        vt = t if (layout.tp > 1) else 1
        logits_inflight = last_inflight if layout.pp > 1 else 1
        v = b * s * model.vocab_size / vt * 8 * logits_inflight
        fwd_bwd.append(Term("logits", v, "b·s·V/t × 8 (fp32 log-softmax + its gradient)",
                            f"{b}·{s}·{model.vocab_size} / {vt} × 8 × {logits_inflight:g}"))
    if layout.cp > 1:
        kv = model.kv_heads * model.head_dim / t
        v = 4 * b * s * kv * ab
        fwd_bwd.append(Term("ring attention buffers", v, "4·b·(s/cp)·kv·Q/t × bytes (K,V double-buffered)",
                            f"4 × {b}·{s}·{g(kv)} × {ab}"))
    if stage == 3 and n > 1:
        if layout.pp > 1:
            # Pipeline stages keep their weights unsharded through the step (reshard_after_forward=False).
            v = psi * wb + rp.largest_unit * gb
            fwd_bwd.append(Term("FSDP unsharded weights", v, "Ψ_stage·w + Ψ_layer·g (no reshard in pipelines)",
                                f"{g(psi)} × {wb} + {g(rp.largest_unit)} × {gb}"))
        else:
            v = rp.largest_unit * (2 * wb + gb)
            fwd_bwd.append(Term("FSDP unsharded weights", v, "Ψ_layer·(2·w + g) (current + prefetched layer)",
                                f"{g(rp.largest_unit)} × (2 × {wb} + {gb})"))
    if hw.transient_slack != 1.0:
        live = total(fwd_bwd)
        fwd_bwd.append(Term("allocator slack", live * (hw.transient_slack - 1), "(slack − 1) × forward/backward",
                            f"({hw.transient_slack:g} − 1) × {fmt_bytes(live)} ({hw.name} preset)"))
    # foreach AdamW allocates a temporary the size of the local fp32 weights (sqrt of the variance).
    local_master = psi / (n if stage >= 1 and not layout.cpu_offload else 1) * 4
    if layout.cpu_offload:
        local_master = 0.0
    opt = [Term("optimizer scratch", local_master, "4·Ψ/N (foreach AdamW's fp32 temporary)",
                f"4 × {g(psi)} / {n if stage >= 1 else 1}")]

    capacity = cluster.device_mem_bytes * hw.usable_fraction
    host_capacity = cluster.host_mem_per_device * 0.9
    if hw.mem_bytes is None and host:
        capacity -= total(host)  # on CPU, "host" and "device" are the same RAM
    return MemoryEstimate(persistent=persistent, fwd_bwd=fwd_bwd, optimizer_step=opt, host=host,
                          capacity=capacity, host_capacity=host_capacity, rank=which, notes=notes)


def memory_reasons(est: MemoryEstimate, layout: Layout, train: TrainConfig) -> list[str]:
    """Why a layout does not fit, naming the biggest item and the knobs that shrink it."""
    r: list[str] = []
    if est.host and est.host_total > est.host_capacity:
        r.append(f"cpu_offload needs {fmt_bytes(est.host_total)} of host memory per device but each has "
                 f"{fmt_bytes(est.host_capacity)}; add nodes or shard more (dp_shard)")
    if est.peak <= est.capacity:
        return r
    items = {t.name: t.value for t in est.persistent + est.fwd_bwd}
    states = items.get("parameters", 0) + items.get("gradients", 0) + items.get("optimizer states", 0)
    act = sum(items.get(k, 0) for k in ("activations", "backward working set", "recompute (one layer)", "logits"))
    head = f"needs {fmt_bytes(est.peak)} per device of {fmt_bytes(est.capacity)} usable"
    where = f" on the {est.rank} pipeline rank" if est.rank in ("first", "last") else ""
    if act >= states:
        ac = train.activation_checkpointing
        fixes = []
        if ac != "full":
            fixes.append("enable activation checkpointing (training.activation_checkpointing: full)")
        fixes.append("raise tp or cp")
        if (train.micro_batch_size or 2) > 1:
            fixes.append("lower training.micro_batch_size")
        r.append(f"activations need {fmt_bytes(act)} per device{where} ({head}); " + " or ".join(fixes))
    else:
        fixes = []
        if layout.zero_stage < 3 and layout.shard_group > 1:
            fixes.append("use zero_stage: 3")
        fixes += ["shard over more ranks (dp_shard)", "raise tp or pp"]
        if not layout.cpu_offload:
            fixes.append("set cpu_offload: true")
        r.append(f"parameters, gradients and optimizer states need {fmt_bytes(states)} per device{where} "
                 f"({head}); " + " or ".join(fixes))
    return r
