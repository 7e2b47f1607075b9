"""The planner's activation count against the tensors autograd really keeps for parallel/model.py.

One process, no ranks: every tensor saved for backward inside the transformer blocks is caught
with `torch.autograd.graph.saved_tensors_hooks` and its storage counted once; parameters (which
linears save too, but which the planner counts as weights) are left out.
"""

from __future__ import annotations

import pytest
import torch

from parallel.config import EngineConfig, ModelConfig
from parallel.model import build_model, init_weights
from parallel.planner.hardware import make_cluster
from parallel.planner.layout import Layout
from parallel.planner.memory import estimate_memory


def _saved_bytes_in_blocks(cfg: ModelConfig, batch: int, seq: int, dtype: torch.dtype) -> int:
    model = build_model(cfg, "cpu")
    init_weights(model, cfg)
    model.to(dtype)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    h = model.tok_embeddings(tokens).detach().requires_grad_(True)
    cos, sin = model.rope_cos[:seq].unsqueeze(0), model.rope_sin[:seq].unsqueeze(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for layer in model.layers.values():
            h = layer(h, cos, sin)
    # The RoPE tables are shared buffers, not per-step activations.
    for buf in (model.rope_cos, model.rope_sin):
        seen.pop(buf.untyped_storage().data_ptr(), None)
    return sum(seen.values())


@pytest.mark.parametrize(
    ("preset", "batch", "seq", "dtype"),
    [("small", 2, 128, "float32"), ("debug", 4, 64, "float32"), ("small", 2, 128, "bfloat16")],
)
def test_engine_activation_count_matches_saved_tensors(preset: str, batch: int, seq: int, dtype: str) -> None:
    torch.manual_seed(0)
    job = EngineConfig.model_validate({
        "model": {"preset": preset},
        "training": {"seq_len": seq, "global_batch_size": batch, "dtype": dtype},
    })
    est = estimate_memory(job.model, job.training, Layout(), make_cluster(1, "cpu"))
    predicted = est.item("activations")
    measured = _saved_bytes_in_blocks(job.model, batch, seq, getattr(torch, dtype))
    assert predicted == pytest.approx(measured, rel=0.10), (predicted, measured)
