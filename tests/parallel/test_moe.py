"""The MoE layer in one process: routing against a per-token reference, the aux loss, the model family."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel.config import ModelConfig
from parallel.model import build_model, init_weights
from parallel.moe import MoE, load_imbalance, moe_stats, set_aux_scale


def _cfg(**moe: object) -> ModelConfig:
    return ModelConfig(preset="mixtral-tiny", moe={"num_experts": 4, "top_k": 2, **moe})


def _layer(cfg: ModelConfig, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    m = MoE(cfg)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m


def _reference(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: Σ_k renormalised softmax weight · expert(x)."""
    flat = x.reshape(-1, x.shape[-1])
    probs = torch.softmax(flat @ m.gate.weight.t(), dim=-1)
    out = []
    for t in range(flat.shape[0]):
        w, idx = torch.topk(probs[t], m.top_k)
        w = w / w.sum()
        acc = torch.zeros_like(flat[t])
        for wk, e in zip(w, idx.tolist(), strict=True):
            h = F.silu(m.experts.w1[e] @ flat[t]) * (m.experts.w3[e] @ flat[t])
            acc = acc + wk * (m.experts.w2[e] @ h)
        out.append(acc)
    return torch.stack(out).view_as(x)


def test_forward_and_backward_match_per_token_reference() -> None:
    cfg = _cfg(aux_loss_coef=0.0)
    m = _layer(cfg)
    x = torch.randn(3, 5, cfg.dim, requires_grad=True)
    out = m(x)
    ref = _reference(m, x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, *m.parameters()], g)
    ref_grads = torch.autograd.grad(ref, [x, *m.parameters()], g)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)  # sums of ~1e2-sized terms in another order
    counts = moe_stats(m)["tokens_per_expert"]
    assert counts.sum().item() == 3 * 5 * 2  # every token reaches top_k experts: dropless


def test_aux_loss_gradient_is_injected_with_its_scale() -> None:
    cfg = _cfg(aux_loss_coef=0.5)
    m = _layer(cfg, seed=1)
    x = torch.randn(2, 6, cfg.dim, requires_grad=True)
    set_aux_scale(m, 0.25)
    out = m(x)
    got = torch.autograd.grad(out.sum(), [x, m.gate.weight])

    # Explicit: the per-sequence Switch loss E·Σ f_i P_i, added with weight 0.25 per sequence.
    set_aux_scale(m, 0.0)
    out2 = m(x)
    probs = torch.softmax(x @ m.gate.weight.t(), dim=-1)
    top_i = probs.topk(2, dim=-1).indices
    f = F.one_hot(top_i, 4).sum(dim=2).float().mean(dim=1) / 2  # (batch, experts)
    aux = 4 * (f * probs.mean(dim=1)).sum(dim=-1)
    want = torch.autograd.grad(out2.sum() + 0.25 * aux.sum(), [x, m.gate.weight])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(moe_stats(m)["aux_loss_sum"], aux.sum().detach())


def test_aux_loss_is_one_when_router_is_uniform() -> None:
    cfg = _cfg()
    m = _layer(cfg)
    with torch.no_grad():
        m.gate.weight.zero_()
        m(torch.randn(4, 8, cfg.dim))
    stats = moe_stats(m)
    torch.testing.assert_close(stats["aux_loss_sum"] / 4, torch.tensor(1.0))
    assert load_imbalance(torch.tensor([[2.0, 2.0], [1.0, 3.0]])) == (1.0 + 1.5) / 2


def test_mixtral_family_builds_initialises_and_learns() -> None:
    cfg = ModelConfig(preset="mixtral-tiny", moe={"num_experts": 4, "top_k": 2, "every_n_layers": 2})
    model = build_model(cfg)
    init_weights(model, cfg, device="cpu")
    names = dict(model.named_parameters())
    assert names["layers.1.feed_forward.experts.w1"].shape == (4, cfg.ffn_dim, cfg.dim)
    assert "layers.0.feed_forward.w1.weight" in names  # every_n_layers=2: layer 0 stays dense
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 16, (4, 17), generator=gen)
    losses = []
    for _ in range(8):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5
    assert model.layers["1"].feed_forward.experts.w1.grad is None  # zero_grad cleared it


def test_trainer_reports_moe_metrics() -> None:
    from parallel.config import EngineConfig
    from parallel.trainer import Trainer

    cfg = EngineConfig.model_validate({
        "model": {"preset": "mixtral-tiny", "moe": {"num_experts": 4, "top_k": 2}},
        "training": {"steps": 2, "seq_len": 16, "global_batch_size": 4, "warmup_steps": 0},
    })
    extra = Trainer(cfg, device=torch.device("cpu")).train_step().extra
    assert 0.9 < extra["moe_aux_loss"] < 4.0  # E·Σ f·P is 1 when balanced, at most E
    assert extra["moe_load_imbalance"] >= 1.0


def test_padding_rows_add_no_aux_gradient() -> None:
    from parallel.moe import set_row_mask

    cfg = _cfg(aux_loss_coef=1.0)
    m = _layer(cfg, seed=2)
    x = torch.randn(3, 4, cfg.dim)
    set_aux_scale(m, 0.5)
    set_row_mask(m, torch.tensor([True, False, True]))
    masked = torch.autograd.grad(m(x).sum(), m.gate.weight)[0]
    set_row_mask(m, None)
    keep = torch.autograd.grad(m(x[[0, 2]]).sum(), m.gate.weight)[0]  # the real rows alone
    padded_out = torch.autograd.grad(m(x[[1]]).sum(), m.gate.weight)[0]
    set_aux_scale(m, 0.0)
    no_aux = torch.autograd.grad(m(x[[1]]).sum(), m.gate.weight)[0]
    torch.testing.assert_close(masked, keep + no_aux, atol=1e-4, rtol=1e-4)  # gradients of order 10
    assert not torch.allclose(padded_out, no_aux)  # the row would have had an aux gradient
