"""Layout search, choose_layout, check_fits: impossible requests give reasons, never crashes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from parallel.config import EngineConfig, ParallelConfig
from parallel.planner import PlanError, check_fits, choose_layout, make_cluster, plan, plan_from_spec
from parallel.planner.layout import Layout, spans_nodes
from parallel.planner.memory import estimate_memory
from parallel.planner.search import evaluate
from parallel.planner.timing import estimate_time


def cfg(model: dict[str, Any] | str, parallelism: Any = None, **training: Any) -> EngineConfig:
    t = {"seq_len": 4096, "global_batch_size": 64, "micro_batch_size": 1, "dtype": "bfloat16", **training}
    # A preset name gets a rope table long enough for seq_len; a dict is taken as it is.
    m = {"preset": model, "max_seq_len": max(4096, t["seq_len"])} if isinstance(model, str) else model
    data: dict[str, Any] = {"model": m, "training": t}
    if parallelism is not None:
        data["parallelism"] = parallelism
    return EngineConfig.model_validate(data)


GQA_12_4 = {"dim": 768, "n_heads": 12, "n_kv_heads": 4, "n_layers": 2, "vocab_size": 1024}

# (job, gpus, gpu, nodes, text every reason list must contain)
IMPOSSIBLE = [
    (cfg(GQA_12_4, {"tp": 3, "dp_shard": 1}, seq_len=256), 3, "h100", None, "kv heads"),
    (cfg("llama3-70b", {"dp_shard": 1}), 1, "h100", None, "optimizer states need"),
    (cfg("llama3-70b", "auto"), 1, "h100", None, "optimizer states need"),
    (cfg("llama3-8b", {"tp": 16}), 8, "h100", None, "does not divide"),
    (cfg("llama3-8b", {"tp": 3}), 8, "h100", None, "does not divide"),
    (cfg("llama3-8b", {"dp_shard": 3}), 8, "h100", None, "but the cluster has 8 devices"),
    (cfg({"preset": "tiny"}, {"dp_shard": 2}, seq_len=8192), 2, "h100", None, "max_seq_len"),
    (cfg("tiny", {"cp": 4, "dp_shard": 1}, seq_len=36), 4, "h100", None, "2·cp"),
    (cfg("tiny", {"ep": 2, "dp_shard": 2}, seq_len=64), 2, "h100", None, "MoE"),
    (cfg("tiny", {"dp_shard": 8}, seq_len=64, global_batch_size=4), 8, "h100", None, "padding only"),
    (cfg("tiny", {"pp": 4, "dp_shard": 1}, seq_len=64), 4, "h100", None, "layers"),
    (cfg("llama3-8b", {"dp_shard": 8}, seq_len=8192, micro_batch_size=8), 8, "h100", None,
     "activation checkpointing"),
    (cfg("llama3-70b", {"dp_shard": 8, "cpu_offload": True}), 8, "a100", None, "host memory"),
]


@pytest.mark.parametrize(("job", "gpus", "gpu", "nodes", "needle"), IMPOSSIBLE)
def test_impossible_requests_return_reasons(job: EngineConfig, gpus: int, gpu: str, nodes: int | None,
                                            needle: str) -> None:
    cluster = make_cluster(gpus, gpu, nodes)
    reasons = check_fits(job.model, job.training, job.parallelism, cluster)
    assert reasons and any(needle in r for r in reasons), reasons
    out = plan_from_spec(job, gpus, gpu, nodes)
    json.dumps(out)  # JSON-able
    if job.parallelism.auto:
        assert not out["ok"] and out["reasons"]
        with pytest.raises(PlanError) as e:
            choose_layout(job.model, job.training, job.parallelism, cluster)
        assert any(needle in r for r in e.value.reasons)
    else:
        assert out["requested"]["fits"] is False
        assert any(needle in r for r in out["requested"]["reasons"])


@pytest.mark.parametrize(
    ("gpus", "gpu", "nodes", "needle"),
    [(6, "h100", 4, "not divisible by nodes"), (16, "h100", 1, "raise --nodes"), (0, "h100", None, "at least one"),
     (8, "tpu", None, "unknown gpu")],
)
def test_bad_clusters_are_refused_with_the_fix(gpus: int, gpu: str, nodes: int | None, needle: str) -> None:
    out = plan_from_spec(cfg("tiny"), gpus, gpu, nodes)
    assert out["ok"] is False and any(needle in r for r in out["errors"]), out["errors"]
    with pytest.raises(PlanError, match=needle):
        make_cluster(gpus, gpu, nodes)


def test_fixed_sizes_that_cannot_divide_the_world() -> None:
    out = plan_from_spec(cfg("llama3-8b", {"auto": True, "tp": 3}), 8, "h100")
    assert not out["ok"] and "does not divide the 8 devices" in out["errors"][0]


def test_auto_picks_a_fitting_layout_that_fills_the_world() -> None:
    job = cfg("llama3-8b", "auto", seq_len=8192)
    cluster = make_cluster(8, "h100")
    chosen = choose_layout(job.model, job.training, job.parallelism, cluster)
    assert not chosen.auto
    assert chosen.dp_replicate * chosen.dp_shard * chosen.cp * chosen.tp * chosen.pp == 8
    assert check_fits(job.model, job.training, chosen, cluster) == []
    result = plan(job, cluster)
    assert result.best is not None and result.best.layout.to_parallel_config(job.parallelism) == chosen
    speeds = [c.tokens_per_s for c in result.candidates]
    assert all(a >= b * 0.995 for a, b in zip(speeds, speeds[1:], strict=False))  # ranked fastest first
    assert result.rejected and all(r.reasons for r in result.rejected)


def test_partial_auto_keeps_the_sizes_the_spec_sets() -> None:
    job = cfg("llama3-8b", {"auto": True, "tp": 2, "pp": 2})
    chosen = choose_layout(job.model, job.training, job.parallelism, make_cluster(16, "h100"))
    assert (chosen.tp, chosen.pp) == (2, 2)
    assert chosen.dp_replicate * chosen.dp_shard * chosen.cp == 4
    assert chosen.pp_microbatches is not None and chosen.pp_microbatches >= 2


def test_dp_shard_fill_is_resolved_and_nothing_else_moves() -> None:
    job = cfg("llama3-8b", {"tp": 2})
    chosen = choose_layout(job.model, job.training, job.parallelism, make_cluster(16, "h100"))
    assert (chosen.tp, chosen.dp_shard, chosen.dp_replicate, chosen.pp, chosen.cp) == (2, 8, 1, 1, 1)


def test_resize_recheck() -> None:
    job = cfg("llama3-8b", {"dp_shard": -1}, seq_len=8192, activation_checkpointing="selective")
    assert check_fits(job.model, job.training, job.parallelism, make_cluster(8, "h100")) == []
    reasons = check_fits(job.model, job.training, job.parallelism, make_cluster(1, "h100"))
    assert reasons and "per device" in reasons[0]


def _mem(job: EngineConfig, layout: Layout, gpus: int = 8, gpu: str = "h100") -> float:
    return estimate_memory(job.model, job.training, layout, make_cluster(gpus, gpu)).peak


def test_memory_moves_the_right_way() -> None:
    job = cfg("llama3-8b", seq_len=8192)
    full = cfg("llama3-8b", seq_len=8192, activation_checkpointing="full")
    sel = cfg("llama3-8b", seq_len=8192, activation_checkpointing="selective")
    fsdp8 = Layout(dp_shard=8)
    assert _mem(job, Layout(dp_shard=2, dp_replicate=4)) > _mem(job, fsdp8)
    assert _mem(job, Layout(dp_shard=8, zero_stage=1)) > _mem(job, Layout(dp_shard=8, zero_stage=2)) > _mem(job, fsdp8)
    assert _mem(job, fsdp8) > _mem(sel, fsdp8) > _mem(full, fsdp8)
    assert _mem(job, Layout(dp_shard=4, tp=2)) < _mem(job, fsdp8)
    assert _mem(job, Layout(dp_shard=4, cp=2)) < _mem(job, fsdp8)
    # 1F1B: the first stage holds p micro-batches; GPipe holds all m of them.
    one = Layout(pp=4, dp_shard=2, pp_schedule="1f1b", pp_microbatches=8)
    gpipe = Layout(pp=4, dp_shard=2, pp_schedule="gpipe", pp_microbatches=8)
    e1 = estimate_memory(job.model, job.training, one, make_cluster(8, "h100"))
    eg = estimate_memory(job.model, job.training, gpipe, make_cluster(8, "h100"))
    assert eg.item("activations") == pytest.approx(2 * e1.item("activations"))  # m=8 vs p=4
    # CPU offload moves the model states to the host.
    off = estimate_memory(job.model, job.training, Layout(dp_shard=8, cpu_offload=True), make_cluster(8, "h100"))
    assert off.item("optimizer states") == 0 and off.host_total > 0 and off.peak < _mem(job, fsdp8)


def test_expert_parallel_divides_the_experts() -> None:
    job = cfg("mixtral-8x7b")
    cl = make_cluster(8, "h100")
    ep1 = estimate_memory(job.model, job.training, Layout(dp_replicate=8), cl)
    ep8 = estimate_memory(job.model, job.training, Layout(dp_shard=8, ep=8, zero_stage=1), cl)
    assert ep8.item("parameters") < ep1.item("parameters") / 3
    t = estimate_time(job.model, job.training, Layout(dp_shard=8, ep=8), cl)
    assert any(c.term.name == "EP all-to-all" for c in t.comm)


def test_bandwidth_tiers() -> None:
    two_nodes = make_cluster(16, "h100")
    assert two_nodes.nodes == 2
    assert not spans_nodes(Layout(tp=8, dp_shard=2), "tp", two_nodes)
    assert spans_nodes(Layout(tp=8, dp_shard=2), "fsdp", two_nodes)
    assert spans_nodes(Layout(dp_shard=16), "fsdp", two_nodes)
    assert not spans_nodes(Layout(dp_replicate=2, dp_shard=8), "fsdp", two_nodes)
    job = cfg("llama3-8b")
    inside = estimate_time(job.model, job.training, Layout(dp_replicate=2, dp_shard=8), two_nodes)
    across = estimate_time(job.model, job.training, Layout(dp_shard=16), two_nodes)
    assert inside.comm_total < across.comm_total


def test_pipeline_bubble_shrinks_with_microbatches() -> None:
    job = cfg("llama3-8b")
    cl = make_cluster(8, "h100")
    few = estimate_time(job.model, job.training, Layout(pp=4, dp_shard=2, pp_microbatches=4), cl)
    many = estimate_time(job.model, job.training, Layout(pp=4, dp_shard=2, pp_microbatches=32), cl)
    assert few.bubble.value > many.bubble.value > 0


def test_requested_layout_is_evaluated_and_json_is_complete() -> None:
    out = plan_from_spec(cfg("llama3-8b", {"dp_shard": -1}, seq_len=8192, activation_checkpointing="selective"), 8, "h100")
    text = json.dumps(out)
    assert out["ok"] and out["requested"]["fits"] and out["requested"]["layout"] == "dp_shard=8"
    best = out["best"]
    assert best["tokens_per_s"] > 0 and 0 < best["mfu"] < 0.4 and best["peak_memory_bytes"] < best["capacity_bytes"]
    names = {t["name"] for t in best["memory"]["persistent"] + best["memory"]["fwd_bwd"]}
    assert {"parameters", "gradients", "optimizer states", "activations"} <= names
    assert "formula" in text and "filled" in text


def test_evaluate_never_raises_on_odd_layouts() -> None:
    job = cfg("mixtral-tiny", seq_len=64)
    cl = make_cluster(8, "cpu")
    for layout in (Layout(dp_shard=8, ep=3), Layout(pp=8), Layout(cp=8), Layout(tp=8), Layout(dp_shard=2, ep=4)):
        res = evaluate(job.model, job.training, layout, cl)
        assert getattr(res, "reasons", None) or res.tokens_per_s > 0


def test_to_parallel_config_round_trips() -> None:
    base = ParallelConfig(auto=True, zero_stage=2)
    pc = Layout(dp_shard=2, tp=2, pp=2, pp_microbatches=4, zero_stage=2).to_parallel_config(base)
    assert (pc.auto, pc.dp_shard, pc.tp, pc.pp, pc.pp_microbatches, pc.zero_stage) == (False, 2, 2, 2, 4, 2)


def test_allowed_dims_limit_the_search() -> None:
    job = cfg("llama3-8b", "auto", seq_len=8192, activation_checkpointing="full")
    cluster = make_cluster(16, "h100")
    chosen = choose_layout(job.model, job.training, job.parallelism, cluster,
                           allowed_dims=("dp_replicate", "dp_shard", "tp"))
    assert (chosen.pp, chosen.cp, chosen.ep) == (1, 1, 1)
    out = plan_from_spec(job, 16, "h100", allowed_dims=("dp_shard",))
    assert out["ok"] and all(c["parallelism"]["tp"] == 1 for c in out["candidates"])


def test_korthikanti_activation_model_is_selectable() -> None:
    job = cfg("llama3-8b", {"dp_shard": -1}, seq_len=8192, activation_checkpointing="selective")
    cl = make_cluster(8, "h100")
    eng = estimate_memory(job.model, job.training, Layout(dp_shard=8), cl)
    kor = estimate_memory(job.model, job.training, Layout(dp_shard=8), cl, activation_model="korthikanti")
    # Llama's SwiGLU (3.5h), GQA expansion and bf16 norms keep more than the GPT layer's 34sbh.
    assert kor.item("activations") < eng.item("activations")
    s, h = 8192, 4096
    kept, ckpt = 16, 16  # every other block checkpointed
    assert kor.item("activations") == pytest.approx(kept * s * h * 34 + ckpt * s * h * 2)
    out = plan_from_spec(job, 8, "h100", activation_model="korthikanti")
    assert out["ok"]
