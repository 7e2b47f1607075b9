"""Every layout rule, held against every caller of the layout rules (parallel/layout_rules.py).

One table: each row breaks one rule and names the field it must be reported under and a phrase of
its message. Each caller must refuse the row the same way: the engine (ParallelDims), the local
launcher's pre-start check (`unbroken train`), the planner (check_fits), the resize check
(service.autolayout.check_resize), the submit checks (service.sizing and service.validation), the
pipeline code (parallel/pp.py) and ParallelConfig itself, each where the rule is its to see.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from parallel import layout_rules, pp
from parallel.config import EngineConfig, ParallelConfig
from parallel.dims import ParallelDims
from parallel.layout_rules import ParallelDimsError, layout_at_dp
from parallel.planner import check_fits, make_cluster
from parallel.planner.layout import Layout
from parallel.planner.search import Rejected, evaluate
from service import autolayout, sizing
from service.spec import JobSpec, parse_spec
from service.validation import job_problems
from workers.launcher import LaunchConfigError, check_job

TINY: dict[str, Any] = {"preset": "tiny"}  # dim 64, 4 heads, 2 kv heads, ffn 176, vocab 256, 2 layers
MOE: dict[str, Any] = {"preset": "mixtral-tiny"}  # tiny with 4 experts, top 2
TRAIN: dict[str, Any] = {"steps": 2, "seq_len": 32, "global_batch_size": 8}

ENGINE = ("dims", "launcher", "planner", "resize", "sizing", "validation")  # everyone who sees a whole layout
WHOLE_JOB = ("dims", "launcher", "sizing", "validation")  # the planner plans even stage splits only


@dataclass
class Rule:
    name: str
    parallelism: dict[str, Any]
    field: str
    phrase: str
    model: dict[str, Any] = field(default_factory=lambda: dict(TINY))
    training: dict[str, Any] = field(default_factory=dict)
    dp: int = 1
    callers: tuple[str, ...] = ENGINE

    def job(self) -> JobSpec:
        return parse_spec({"model": self.model, "training": {**TRAIN, **self.training},
                           "parallelism": self.parallelism, "resources": {"dp": {"min": self.dp, "max": self.dp}}})


RULES = [
    Rule("tp divides the heads", {"tp": 3}, "parallelism.tp", "tp=3 does not divide n_heads=4"),
    Rule("tp divides the kv heads", {"tp": 4}, "parallelism.tp", "tp=4 does not divide n_kv_heads=2"),
    Rule("tp divides the MLP width", {"tp": 2}, "parallelism.tp", "ffn dim (hidden_dim)=177",
         model={**TINY, "hidden_dim": 177}),
    Rule("tp divides the vocabulary", {"tp": 2}, "parallelism.tp", "vocab_size=255", model={**TINY, "vocab_size": 255}),
    Rule("tp divides the expert width", {"tp": 2}, "parallelism.tp", "moe.hidden_dim=177",
         model={**MOE, "moe": {"num_experts": 4, "top_k": 2, "hidden_dim": 177}}),
    # seq_len 6 splits into cp=2 halves but not into the 2·cp zigzag chunks (the old sizing copy let it by).
    Rule("cp splits the sequence in 2·cp", {"cp": 2}, "parallelism.cp", "cp*2=4 does not divide training.seq_len=6",
         training={"seq_len": 6}),
    Rule("ep needs experts", {"ep": 2}, "parallelism.ep", "ep=2 needs a mixture-of-experts model", dp=2),
    Rule("ep divides the experts", {"ep": 2}, "parallelism.ep", "ep=2 does not divide moe.num_experts=3",
         model={**MOE, "moe": {"num_experts": 3, "top_k": 2}}, dp=2),
    Rule("ep within dp_shard x cp", {"ep": 4}, "parallelism.ep", "ep=4 does not divide dp_shard*cp=2",
         model=dict(MOE), dp=2),
    Rule("ep spans all of cp", {"ep": 2, "cp": 4}, "parallelism.ep", "cp=4 does not divide ep=2",
         model=dict(MOE), dp=2),
    Rule("every stage needs a layer", {"pp": 4}, "parallelism.pp", "pp stages=4 exceed n_layers=2"),
    Rule("pp_split has one entry a stage", {"pp": 2, "pp_split": [2]}, "parallelism.pp_split",
         "pp_split has 1 entries but there are 2 stages", callers=WHOLE_JOB),
    Rule("pp_split sums to the layers", {"pp": 2, "pp_split": [1, 2]}, "parallelism.pp_split",
         "sums to 3 but model.n_layers=2", callers=WHOLE_JOB),
    Rule("one stage a rank for 1f1b", {"pp": 2, "pp_stages_per_rank": 2}, "parallelism.pp_stages_per_rank",
         "pp_schedule=1f1b runs one stage per rank", model={**TINY, "n_layers": 4}),
    Rule("micro-batches split the rank's batch", {"pp": 2, "pp_microbatches": 3}, "parallelism.pp_microbatches",
         "does not split into parallelism.pp_microbatches=3 equal micro-batches"),
    Rule("a sequence for every dp rank", {}, "training.global_batch_size", "global_batch_size=2 is smaller than dp=4",
         training={"global_batch_size": 2}, dp=4),
    Rule("the sequence fits the model", {}, "training.seq_len", "training.seq_len=32 exceeds model.max_seq_len=16",
         model={**TINY, "max_seq_len": 16}),
]


def _engine(rule: Rule) -> tuple[EngineConfig, int]:
    job = rule.job()
    at = layout_at_dp(job.parallelism, rule.dp)
    cfg = EngineConfig(model=job.model, training=job.training, parallelism=at)
    return cfg, rule.dp * layout_rules.model_parallel_size(at)


def _fields(problems: list[tuple[str, str]], phrase: str) -> list[str]:
    return [f for f, message in problems if phrase in message]


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_every_caller_refuses_the_rule(rule: Rule) -> None:
    job = rule.job()
    cfg, world = _engine(rule)
    seen = []
    if "dims" in rule.callers:
        with pytest.raises(ParallelDimsError) as e:
            ParallelDims.from_config(cfg.parallelism, world).validate(cfg.model, cfg.training, cfg.parallelism)
        assert _fields([p.pair() for p in e.value.problems], rule.phrase) == [rule.field], e.value.problems
        seen.append("dims")
    if "launcher" in rule.callers:
        with pytest.raises(LaunchConfigError, match=re.escape(rule.phrase)):
            check_job(cfg, world)
        seen.append("launcher")
    if "planner" in rule.callers:
        reasons = check_fits(cfg.model, cfg.training, cfg.parallelism, make_cluster(world, "cpu"))
        assert any(rule.phrase in r for r in reasons), reasons
        seen.append("planner")
    if "resize" in rule.callers:
        reasons = autolayout.check_resize(job, rule.dp, make_cluster(world, "cpu"))
        assert any(rule.phrase in r for r in reasons), reasons
        seen.append("resize")
    if "sizing" in rule.callers:
        assert rule.field in _fields(sizing.layout_problems(job), rule.phrase), sizing.layout_problems(job)
        seen.append("sizing")
    if "validation" in rule.callers:
        assert rule.field in _fields(job_problems(job), rule.phrase), job_problems(job)
        seen.append("validation")
    assert seen == list(rule.callers)


def test_the_pipeline_code_refuses_its_rules() -> None:
    """parallel/pp.py raises the authority's problems (a PipelineConfigError is a ParallelDimsError)."""
    with pytest.raises(pp.PipelineConfigError, match="pp stages=4 exceed n_layers=2") as e:
        pp.layers_per_stage(2, 4)
    assert isinstance(e.value, ParallelDimsError) and e.value.problems[0].field == "parallelism.pp"
    with pytest.raises(pp.PipelineConfigError, match="sums to 3 but model.n_layers=2"):
        pp.layers_per_stage(2, 2, [1, 2])
    with pytest.raises(pp.PipelineConfigError, match="runs one stage per rank"):
        pp.num_virtual_stages(ParallelConfig(pp=2, pp_stages_per_rank=2))
    with pytest.raises(pp.PipelineConfigError, match="pp_microbatches=3 equal micro-batches"):
        pp.build_schedule([], [], 2, ParallelConfig(pp=2, pp_microbatches=3), None, torch.device("cpu"),
                          lambda a, b: a, 8)


# The rules the parallelism section decides alone: ParallelConfig refuses them as it is parsed, and
# the planner and the pipeline code refuse the same layouts when they are handed one.
SECTION_RULES = [
    ({"pp": 4, "pp_microbatches": 2}, "parallelism.pp_microbatches=2 must be >= pp=4"),
    ({"pp": 2, "pp_schedule": "zbv", "pp_stages_per_rank": 3}, "pp_schedule=zbv uses exactly 2 stages per rank"),
    ({"dp_shard": 0}, "dp_shard=0 must be a positive integer or -1"),
]


@pytest.mark.parametrize(("sizes", "phrase"), SECTION_RULES, ids=[p for _, p in SECTION_RULES])
def test_section_rules(sizes: dict[str, Any], phrase: str) -> None:
    with pytest.raises(ValueError, match=re.escape(phrase)):
        ParallelConfig(**sizes)
    job = EngineConfig(model={**TINY, "n_layers": 8}, training=TRAIN)
    if "dp_shard" in sizes:
        with pytest.raises(ParallelDimsError, match=re.escape(phrase)):
            ParallelDims(dp_replicate=1, dp_shard=0, cp=1, tp=1, pp=1, ep=1, world_size=1)
        return
    layout = Layout(pp=sizes["pp"], pp_schedule=sizes.get("pp_schedule", "1f1b"),
                    pp_microbatches=sizes.get("pp_microbatches"), pp_stages_per_rank=sizes.get("pp_stages_per_rank", 1))
    res = evaluate(job.model, job.training, layout, make_cluster(layout.world, "cpu"))
    assert isinstance(res, Rejected) and any(phrase in r for r in res.reasons), res
    unchecked = ParallelConfig.model_construct(**{**ParallelConfig().model_dump(), **sizes})
    with pytest.raises(pp.PipelineConfigError, match=re.escape(phrase)):
        if "pp_microbatches" in sizes:
            pp.build_schedule([], [], sizes["pp"], unchecked, None, torch.device("cpu"), lambda a, b: a, 8)
        else:
            pp.num_virtual_stages(unchecked)


# The world: only the engine, the launcher and the planner are handed one (the service derives it).
WORLD_RULES = [
    ({"tp": 3}, 4, "dp_replicate*cp*tp*pp=3 does not divide world_size=4"),
    ({"tp": 2, "dp_shard": 3}, 4, "dp_replicate*dp_shard*cp*tp*pp=6 != world_size=4"),
]


@pytest.mark.parametrize(("sizes", "world", "phrase"), WORLD_RULES, ids=[p for *_, p in WORLD_RULES])
def test_world_rules(sizes: dict[str, Any], world: int, phrase: str) -> None:
    cfg = EngineConfig(model=TINY, training=TRAIN, parallelism=sizes)
    with pytest.raises(ParallelDimsError, match=re.escape(phrase)) as e:
        ParallelDims.from_config(cfg.parallelism, world)
    assert [p.field for p in e.value.problems] == ["parallelism"]
    with pytest.raises(LaunchConfigError, match=re.escape(phrase)):
        check_job(cfg, world)
    reasons = check_fits(cfg.model, cfg.training, cfg.parallelism, make_cluster(world, "cpu"))
    assert any(phrase in r for r in reasons), reasons


# The dp range of an elastic job (resources.dp): the submit checks' to see.
DP_RULES = [
    ({"dp_shard": 2}, {"max": 4}, "resources.dp.max", "exceeds the parallelism's dp_replicate×dp_shard=2"),
    ({"dp_shard": 2}, {"min": 3}, "resources.dp.min", "exceeds the parallelism's dp_replicate×dp_shard=2"),
    ({"dp_replicate": 2}, {"min": 3}, "resources.dp.min", "is not a multiple of parallelism.dp_replicate=2"),
]


@pytest.mark.parametrize(("sizes", "dp", "field", "phrase"), DP_RULES, ids=[f"{f} {p}" for _, _, f, p in DP_RULES])
def test_dp_range_rules(sizes: dict[str, Any], dp: dict[str, int], field: str, phrase: str) -> None:
    job = parse_spec({"model": TINY, "training": TRAIN, "parallelism": sizes, "resources": {"dp": dp}})
    assert field in _fields(sizing.layout_problems(job), phrase)
    assert field in _fields(job_problems(job), phrase)


def test_one_layout_at_a_new_dp() -> None:
    """HSDP at a new dp: the worker's resize, the resize check and the submit checks form the same layout."""
    from parallel.layout_rules import engine_at_dp

    assert autolayout.layout_at_dp is layout_at_dp
    cfg = EngineConfig(model=TINY, training=TRAIN, parallelism={"dp_replicate": 2, "dp_shard": 4, "tp": 2})
    for dp, (rep, shard) in {8: (2, 4), 6: (2, 3), 3: (1, 3), 1: (1, 1)}.items():
        at = layout_at_dp(cfg.parallelism, dp)
        assert (at.dp_replicate, at.dp_shard, at.tp) == (rep, shard, 2)
        assert engine_at_dp(cfg, dp).parallelism == at
    assert cfg.parallelism.dp_shard == 4  # the caller's config is not changed
    # HSDP with 2 replicas shrunk to dp=3 runs plain FSDP over 3: the resize check judges that layout.
    job = parse_spec({"model": TINY, "training": {**TRAIN, "global_batch_size": 3},
                      "parallelism": {"dp_replicate": 2, "dp_shard": -1, "tp": 2}, "resources": {"dp": {"min": 2}}})
    assert job_problems(job) == []
    assert autolayout.check_resize(job, 3, make_cluster(6, "cpu")) == []


@pytest.mark.parametrize(("sizes", "min_size", "units"), [
    ([1, 1, 1, 1], 0, [[0], [1], [2], [3]]),  # 0: a unit per block (a big model's blocks)
    ([5], 0, [[0]]),
    ([1, 1, 1, 1], 2, [[0, 1], [2, 3]]),
    ([1, 1, 1, 1, 1], 2, [[0, 1], [2, 3, 4]]),  # a short tail joins the unit before it
    ([3, 1, 1, 3], 2, [[0], [1, 2], [3]]),
    ([1, 1, 1, 1], 3, []),  # one unit of every block: the blocks are the root's
    ([1, 1], 100, []),
    ([], 1, []),
])
def test_fsdp_units_group_consecutive_blocks(sizes: list[float], min_size: float, units: list[list[int]]) -> None:
    got = layout_rules.fsdp_units(sizes, min_size)
    assert [list(u) for u in got] == units
    if got:  # every block in exactly one unit, in order
        assert [i for u in got for i in u] == list(range(len(sizes)))
