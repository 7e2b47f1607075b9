"""Pipeline parallelism: stage splitting, and every schedule against one process over 10 steps.

Two launches: pp=2 (2 ranks) with each schedule, and pp=2 × fsdp=2 (4 ranks) with each
schedule (FSDP stages keep parameters unsharded after forward, as zero-bubble needs).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.config import ModelConfig, ParallelConfig
from parallel.model import build_model, init_weights
from parallel.moe import set_aux_scale
from parallel.pp import (
    SCHEDULES,
    PipelineConfigError,
    apply_pp,
    bubble_fraction,
    layers_per_stage,
    split_model,
    stage_ids,
)
from tests.parallel._spawn import run_ranks

STEPS = 10
BATCH, SEQ = 8, 16


def _cfg(moe: bool = False) -> ModelConfig:
    extra = {"moe": {"num_experts": 4, "top_k": 2, "every_n_layers": 2}} if moe else {}
    return ModelConfig(preset="tiny", n_layers=4, **extra)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    seq = torch.randint(0, 64, (BATCH, SEQ + 1), generator=gen)
    return seq[:, :-1], seq[:, 1:]


def _reference(cfg: ModelConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build_model(cfg)
    init_weights(model, cfg, device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum") / y.numel()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _run_pipeline(cfg: ModelConfig, schedule: str, dp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """pp=2 (× fsdp=dp): the per-step global loss and this rank's full parameters."""
    from torch.distributed.device_mesh import init_device_mesh

    from parallel.fsdp import apply_fsdp

    mesh = init_device_mesh("cpu", (2, dp), mesh_dim_names=("pp", "dp"))
    v = 2 if schedule not in ("gpipe", "1f1b") else 1
    p = ParallelConfig(pp=2, dp_shard=dp, pp_schedule=schedule, pp_microbatches=4 if dp == 1 else 2,
                       pp_stages_per_rank=v)
    local_bs = BATCH // dp
    n_tokens = BATCH * SEQ

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # FSDP averages gradients over dp: scale by dp so they add up to the global sum.
        return F.cross_entropy(out.flatten(0, 1), target.flatten(), reduction="sum") * dp / n_tokens

    def parallelize(part: torch.nn.Module) -> torch.nn.Module:
        if dp > 1:
            apply_fsdp(part, mesh["dp"], reshard_after_forward=False)
        init_weights(part, cfg, device="cpu")
        return part

    pipe = apply_pp(build_model(cfg), cfg, p, mesh["pp"], torch.device("cpu"), loss_fn, local_bs, parallelize)
    if cfg.moe is not None:  # one sequence's aux loss weighs coef / global batch, however it is cut
        set_aux_scale(pipe.parts, cfg.moe.aux_loss_coef / BATCH)
    params = [q for part in pipe.parts for q in part.parameters()]
    opt = torch.optim.AdamW(params, lr=2e-3)
    dp_rank = mesh["dp"].get_local_rank()
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        x, y = x[dp_rank * local_bs : (dp_rank + 1) * local_bs], y[dp_rank * local_bs : (dp_rank + 1) * local_bs]
        loss = pipe.step(x, y) / dp
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss)  # only last-stage ranks hold a loss; each holds its dp slice's share
        losses.append(loss.item())
    full: dict[str, torch.Tensor] = {}
    for part in pipe.parts:
        for n, q in part.named_parameters():
            full[n] = q.full_tensor().detach() if hasattr(q, "full_tensor") else q.detach().clone()
    return losses, full


def _pp_worker(rank: int, world: int, schedules: tuple[str, ...], dp: int, moe: bool) -> dict[str, float]:
    cfg = _cfg(moe)
    ref_losses, ref_params = _reference(cfg)
    errs = {}
    for schedule in schedules:
        losses, params = _run_pipeline(cfg, schedule, dp)
        errs[f"pp2 dp{dp} {schedule} loss"] = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
        # Adam turns tiny gradient differences of near-zero gradients into ~lr-sized steps, so
        # the weights get a looser bound than the losses.
        errs[f"pp2 dp{dp} {schedule} weights"] = max((q - ref_params[n]).abs().max().item() for n, q in params.items()) / 10
        dist.barrier()
    return errs


def _check(results: list[dict[str, float]], expected: int) -> None:
    worst: dict[str, float] = {}
    for errs in results:
        for k, e in errs.items():
            worst[k] = max(worst.get(k, 0.0), e)
    assert len(worst) == 2 * expected
    for k, e in worst.items():
        assert e <= 1e-5, f"{k}: max abs error {e:.2e} after {STEPS} steps"


def test_stage_split_and_placement() -> None:
    assert layers_per_stage(10, 4) == [3, 3, 2, 2]
    assert layers_per_stage(4, 2, [1, 3]) == [1, 3]
    with pytest.raises(PipelineConfigError, match="pp_split=\\[1, 2\\] sums to 3 but model.n_layers=4"):
        layers_per_stage(4, 2, [1, 2])
    with pytest.raises(PipelineConfigError, match="pp_split has 3 entries but there are 2 stages"):
        layers_per_stage(4, 2, [1, 2, 1])
    with pytest.raises(PipelineConfigError, match="n_layers=2 is fewer than the 4 pipeline stages"):
        layers_per_stage(2, 4)
    assert stage_ids("interleaved_1f1b", 1, 4, 2) == [1, 5]
    assert stage_ids("zbv", 1, 4, 2) == [1, 6]

    cfg = _cfg()
    p = ParallelConfig(pp=2, pp_schedule="1f1b", pp_split=[1, 3])
    (first,), ids, n = split_model(build_model(cfg), cfg, p, 0)
    (last,), _, _ = split_model(build_model(cfg), cfg, p, 1)
    assert ids == [0] and n == 2
    assert list(first.layers.keys()) == ["0"] and first.output is None and first.tok_embeddings is not None
    assert list(last.layers.keys()) == ["1", "2", "3"] and last.tok_embeddings is None and last.norm is not None
    names = {n for n, _ in first.named_parameters()} | {n for n, _ in last.named_parameters()}
    assert names == {n for n, _ in build_model(cfg).named_parameters()}  # nothing lost, names global

    with pytest.raises(PipelineConfigError, match="pp_schedule=1f1b runs one stage per rank"):
        split_model(build_model(cfg), cfg, ParallelConfig(pp=2, pp_stages_per_rank=2), 0)


def test_bubble_fraction() -> None:
    assert bubble_fraction("1f1b", 4, 8) == 3 / 8
    assert bubble_fraction("interleaved_1f1b", 4, 8, 2) == 3 / 16
    assert bubble_fraction("gpipe", 1, 8) == 0.0


def test_every_schedule_matches_one_process_pp2() -> None:
    _check(run_ranks(_pp_worker, 2, SCHEDULES, 1, False), len(SCHEDULES))


def test_moe_model_pipelines_pp2() -> None:
    # The aux loss rides on the MoE output's gradient, so it crosses stage boundaries unaided.
    _check(run_ranks(_pp_worker, 2, ("1f1b", "zbv"), 1, True), 2)


def test_every_schedule_matches_one_process_pp2_fsdp2() -> None:
    _check(run_ranks(_pp_worker, 4, SCHEDULES, 2, False), len(SCHEDULES))
