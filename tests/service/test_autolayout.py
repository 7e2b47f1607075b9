"""service.autolayout: the cluster a job would run on, `parallelism: auto` resolved against the
job's dp range, and check_resize (the memory and shape re-check of a smaller or larger dp)."""

from __future__ import annotations

from typing import Any

import pytest

from parallel.planner import make_cluster
from service import sizing
from service.autolayout import LayoutRefused, check_resize, cluster_for_job, layout_at_dp, resolve_auto
from service.spec import JobSpec, parse_spec
from service.validation import job_problems

TINY: dict[str, Any] = {"model": {"preset": "tiny"}, "training": {"steps": 2, "seq_len": 32, "global_batch_size": 8}}
EIGHT_B: dict[str, Any] = {"model": {"preset": "llama3-8b"}, "training": {"seq_len": 1024, "global_batch_size": 8}}
RAY_GPUS = {"CPU": 128.0, "GPU": 16.0, "memory": 1e12, "node:10.0.0.1": 1.0, "node:10.0.0.2": 1.0,
            "node:__internal_head__": 1.0, "accelerator_type:H200": 2.0}


def spec(base: dict[str, Any], **sections: Any) -> JobSpec:
    return parse_spec({**base, **sections})


# ---- check_resize ---------------------------------------------------------------------------------


def test_check_resize_fits_and_names_why_not() -> None:
    job = spec(EIGHT_B, parallelism={"dp_shard": 8}, resources={"dp": {"min": 1}, "gpus_per_worker": 1})
    h100 = make_cluster(8, "h100")
    assert check_resize(job, 8, h100) == []
    assert check_resize(job, 4, h100) == []  # 8B's states over 4 ranks: ~30 GiB of 80
    one = check_resize(job, 1, h100)
    assert len(one) == 1 and one[0].startswith("at dp=1 (single device) on h100:")
    assert "per device" in one[0] and "76.00 GiB usable" in one[0]
    # The same shrink fits on the larger device: the verdict comes from the memory model, not the dp.
    assert check_resize(job, 2, make_cluster(8, "h200")) == []
    assert check_resize(job, 2, h100) != []
    assert check_resize(job, 0, h100) == ["dp=0: the data-parallel degree must be at least 1"]


def test_check_resize_shape_reasons_and_hsdp() -> None:
    # A pipeline's micro-batch count is fixed in the spec; at dp=3 the per-rank batch of 3 does not split in 2.
    job = spec(TINY, parallelism={"dp_shard": 4, "pp": 2, "pp_microbatches": 2})
    cpu = make_cluster(8, "cpu")
    assert check_resize(job, 4, cpu) == [] and check_resize(job, 2, cpu) == []
    (reason,) = check_resize(job, 3, cpu)
    assert reason.startswith("at dp=3 (dp_shard=3 pp=2") and "pp_microbatches=2" in reason
    # HSDP keeps its replicate degree when it divides the new dp, else runs plain FSDP (as the runtime does).
    hsdp = spec(TINY, parallelism={"dp_replicate": 2, "dp_shard": 4}).parallelism
    assert (layout_at_dp(hsdp, 6).dp_replicate, layout_at_dp(hsdp, 6).dp_shard) == (2, 3)
    assert (layout_at_dp(hsdp, 3).dp_replicate, layout_at_dp(hsdp, 3).dp_shard) == (1, 3)
    with pytest.raises(ValueError, match="resolve parallelism: auto first"):
        check_resize(spec(TINY, parallelism="auto"), 2, cpu)


# ---- the cluster a job would run on -------------------------------------------------------------


def test_cluster_from_ray_resources() -> None:
    gpu_job = spec(EIGHT_B, resources={"gpus_per_worker": 1})
    jc = cluster_for_job(gpu_job, RAY_GPUS)
    c = jc.cluster
    assert (c.hardware.name, c.world, c.nodes, c.devices_per_node) == ("h200", 16, 2, 8)
    assert "16 GPUs" in jc.source
    # Capped at the job's max world; the preset override wins.
    capped = cluster_for_job(spec(EIGHT_B, resources={"gpus_per_worker": 1, "dp": {"max": 4}}), RAY_GPUS, gpu="a100")
    assert (capped.cluster.hardware.name, capped.cluster.world) == ("a100", 4)
    # An unknown accelerator is planned as h100, and says so.
    odd = cluster_for_job(gpu_job, {"GPU": 4.0, "node:1.2.3.4": 1.0, "accelerator_type:L4": 1.0})
    assert odd.cluster.hardware.name == "h100" and "L4 has no planner preset" in odd.source
    # A job that asks no GPUs runs its workers on CPU even on a GPU cluster.
    cpu_ranks = cluster_for_job(spec(TINY), RAY_GPUS)
    assert (cpu_ranks.cluster.hardware.name, cpu_ranks.cluster.world) == ("cpu", 128)
    assert "gpus_per_worker: 1" in cpu_ranks.source
    two_cpus = cluster_for_job(spec(TINY, resources={"cpus_per_worker": 2}), {"CPU": 8.0})
    assert two_cpus.cluster.world == 4
    assert cluster_for_job(spec(TINY, resources={"dp": {"max": 2}}), {"CPU": 8.0}).cluster.world == 2


def test_cluster_errors_name_the_parameter() -> None:
    with pytest.raises(LayoutRefused) as e:
        cluster_for_job(spec(TINY), None)
    assert e.value.problems[0][0] == "gpus" and "?gpus=N" in e.value.problems[0][1]
    with pytest.raises(LayoutRefused) as e:
        cluster_for_job(spec(TINY), None, gpus=12, nodes=5)
    assert e.value.problems[0][0] == "nodes"
    with pytest.raises(LayoutRefused) as e:
        cluster_for_job(spec(TINY), {"CPU": 0.5})
    assert e.value.problems[0][0] == "resources.cpus_per_worker"
    # One plan covers a bounded number of devices (its cost grows with their divisors).
    with pytest.raises(LayoutRefused) as e:
        cluster_for_job(spec(TINY), None, gpus=5000, gpu="cpu")
    assert e.value.problems[0][0] == "gpus" and "at most 4096 cpu" in e.value.problems[0][1]
    big = cluster_for_job(spec(TINY), {"CPU": 100000.0})
    assert big.cluster.world == 4096 and "capped at 4096" in big.source


# ---- parallelism: auto ---------------------------------------------------------------------------


def test_resolve_auto_gives_a_layout_the_whole_dp_range_can_run() -> None:
    total = {"CPU": 8.0}
    job = spec(TINY, parallelism="auto", resources={"dp": {"min": 2}})
    jc = cluster_for_job(job, total)
    auto = resolve_auto(job, jc, total)
    got = auto.spec
    p = got.parallelism
    assert not p.auto and p.dp_shard >= 1
    assert p.dp_replicate * p.dp_shard * p.cp * p.tp * p.pp == jc.cluster.world == 8
    dp = p.dp_replicate * p.dp_shard
    assert dp >= 2 and check_resize(got, 2, jc.cluster) == [] and job_problems(got, total) == []
    data = auto.event_data()
    assert data["parallelism"]["dp_shard"] == p.dp_shard and data["tokens_per_s"] > 0
    assert 0 < data["peak_memory_bytes"] <= data["capacity_bytes"]
    # Every better-ranked layout that was passed over says why.
    assert all(":" in s for s in data["skipped"])
    # The rest of the spec is untouched.
    assert got.model_dump(exclude={"parallelism", "resources"}) == job.model_dump(exclude={"parallelism", "resources"})


def test_resolve_auto_keeps_explicit_sizes_and_the_dp_range() -> None:
    total = {"CPU": 8.0}
    partial = spec(TINY, parallelism={"auto": True, "tp": 2})
    assert resolve_auto(partial, cluster_for_job(partial, total), total).spec.parallelism.tp == 2
    # dp.min = 8 on 8 ranks leaves one layout family: pure data parallelism.
    wide = spec(TINY, parallelism="auto", resources={"dp": {"min": 8}})
    p = resolve_auto(wide, cluster_for_job(wide, total), total).spec.parallelism
    assert (p.dp_replicate * p.dp_shard, sizing.model_parallel_size(wide.model_copy(update={"parallelism": p}))) == (8, 1)
    # dp.max above the chosen layout's dp is lowered to it, and the note says so.
    capped = spec(TINY, parallelism="auto", resources={"dp": {"max": 8}})
    auto = resolve_auto(capped, cluster_for_job(capped, total), total)
    q = auto.spec.parallelism
    dp = q.dp_replicate * q.dp_shard
    assert auto.spec.resources.dp.max == dp
    assert (dp < 8) == any("resources.dp.max lowered from 8" in n for n in auto.notes)


def test_resolve_auto_refuses_with_the_planners_reasons() -> None:
    total = {"CPU": 8.0}
    huge = spec({"model": {"preset": "llama3-70b"}}, parallelism="auto")
    with pytest.raises(LayoutRefused) as e:
        resolve_auto(huge, cluster_for_job(huge, total), total)
    ((field, msg),) = e.value.problems
    assert field == "parallelism" and msg.startswith("no layout fits 8x cpu")
    assert "per device" in msg and "usable" in msg
    # Layouts fit, but none can run at dp.min = 16 (more than the 8 ranks).
    wide = spec(TINY, parallelism="auto", resources={"dp": {"min": 16}})
    with pytest.raises(LayoutRefused) as e:
        resolve_auto(wide, cluster_for_job(wide, total), total)
    assert "none suits the job" in e.value.problems[0][1] and "resources.dp.min=16" in e.value.problems[0][1]
