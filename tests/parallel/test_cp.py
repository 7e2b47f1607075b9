"""Context parallelism: ring attention against full attention, and a CP model against one process.

One launch of 4 gloo ranks checks cp=4 and cp=2 (two groups of 2), zigzag and contiguous
sharding, forward and backward; then whole models (dense and MoE) sharded over cp.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.config import ModelConfig
from parallel.cp import apply_cp, cp_positions, shard_batch, shard_sequence, unshard_sequence
from parallel.model import build_model, init_weights
from tests.parallel._spawn import run_ranks


def _full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _check_ring(group: dist.ProcessGroup, layout: str, seq: int) -> float:
    from parallel.cp import ring_attention

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator().manual_seed(seq + world)
    q, k, v, g = (torch.randn(2, 3, seq, 8, generator=gen) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref = _full_attention(q, k, v)
    ref_grads = torch.autograd.grad(ref, [q, k, v], g)

    def local(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t.detach(), rank, world, dim=2, layout=layout).requires_grad_()

    lq, lk, lv = local(q), local(k), local(v)
    out = ring_attention(lq, lk, lv, group=group, layout=layout)
    grads = torch.autograd.grad(out, [lq, lk, lv], shard_sequence(g, rank, world, dim=2, layout=layout))
    err = (out - shard_sequence(ref, rank, world, dim=2, layout=layout)).abs().max().item()
    for got, want in zip(grads, ref_grads, strict=True):
        err = max(err, (got - shard_sequence(want, rank, world, dim=2, layout=layout)).abs().max().item())
    return err


def _model_loss_and_grads(cfg: ModelConfig, tokens: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[float, dict[str, torch.Tensor]]:
    model = build_model(cfg)
    init_weights(model, cfg, device="cpu")
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    n_tokens = labels.numel()
    if group is None:
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(), reduction="sum") / n_tokens
    else:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        apply_cp(model, group)
        x, y, pos = shard_batch(inputs, labels, rank, world)
        loss = F.cross_entropy(model(x, positions=pos).flatten(0, 1), y.flatten(), reduction="sum") / n_tokens
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    value = loss.detach().clone()
    if group is not None:  # what FSDP over dp×cp would do: sum the shards' losses and gradients
        dist.all_reduce(value, group=group)
        for g in grads.values():
            dist.all_reduce(g, group=group)
    return value.item(), grads


def _cp_worker(rank: int, world: int) -> dict[str, float]:
    errs: dict[str, float] = {}
    full = dist.new_group(list(range(world)))
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    errs["ring cp=4 zigzag"] = _check_ring(full, "zigzag", 32)
    errs["ring cp=4 contiguous"] = _check_ring(full, "contiguous", 12)
    errs["ring cp=2 zigzag"] = _check_ring(pair, "zigzag", 20)

    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (2, 33), generator=gen)
    for name, cfg in {
        "dense": ModelConfig(preset="tiny"),
        "moe": ModelConfig(preset="mixtral-tiny", moe={"num_experts": 4, "top_k": 2, "aux_loss_coef": 0.1}),
    }.items():
        ref_loss, ref_grads = _model_loss_and_grads(cfg, tokens, None)
        for label, group in (("cp=4", full), ("cp=2", pair)):
            loss, grads = _model_loss_and_grads(cfg, tokens, group)
            err = abs(loss - ref_loss)
            for n, g in grads.items():
                err = max(err, (g - ref_grads[n]).abs().max().item())
            errs[f"model {name} {label}"] = err
    return errs


def test_zigzag_sharding_round_trips_and_balances() -> None:
    x = torch.arange(16).view(1, 16)
    parts = [shard_sequence(x, r, 4) for r in range(4)]
    assert parts[0].tolist() == [[0, 1, 14, 15]] and parts[3].tolist() == [[6, 7, 8, 9]]
    assert torch.equal(unshard_sequence(parts), x)
    assert cp_positions(16, 1, 4).tolist() == [2, 3, 12, 13]
    with pytest.raises(ValueError, match="training.seq_len=10 must be divisible by 2·parallelism.cp=8"):
        cp_positions(10, 0, 4)


def test_builtin_cp_is_refused_on_cpu() -> None:
    with pytest.raises(ValueError, match="cp_impl=builtin needs CUDA"):
        apply_cp(torch.nn.Linear(2, 2), object(), impl="builtin")


def test_ring_attention_and_cp_models_match_one_process() -> None:
    results = run_ranks(_cp_worker, 4)
    worst: dict[str, float] = {}
    for errs in results:
        for k, e in errs.items():
            worst[k] = max(worst.get(k, 0.0), e)
    for k, e in worst.items():
        assert e <= 1e-5, f"{k}: max abs error {e:.2e}"
    assert len(worst) == 7


def test_trainer_refuses_builtin_cp_on_cpu() -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from parallel.config import EngineConfig
    from parallel.trainer import Trainer

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        cfg = EngineConfig.model_validate({"parallelism": {"cp": 2, "cp_impl": "builtin"}})
        with pytest.raises(ValueError, match="cp_impl=builtin needs CUDA"):
            Trainer(cfg, device=torch.device("cpu"))
    finally:
        dist.destroy_process_group()
