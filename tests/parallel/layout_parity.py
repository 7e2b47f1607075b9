"""Shared by the PP/CP/EP/composition tests: run layouts through the Trainer, compare with one process.

The layouts of a test run in one launch (`tests.parallel.harness`), each in a freshly formed
process group; the single-process reference runs in the test process.
"""

from __future__ import annotations

from typing import Any

import torch

from parallel.trainer import Trainer
from tests.parallel.harness import launch
from tests.parallel.rank_fns import make_cfg, run_steps

LOSS_TOL = 1e-5  # fp32 losses, every step
WEIGHT_TOL = 1e-4  # final weights: AdamW turns 1e-7 gradient noise on near-zero gradients into larger steps


def parity_many(ctx: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """Rank body: several (base config, layouts) groups in one launch; merged results by layout name."""
    from tests.parallel.rank_fns import parity_layouts

    out: dict[str, Any] = {}
    for run in payload["runs"]:
        out.update(parity_layouts(ctx, run))
    return out


def reference(base: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor]]:
    cfg = make_cfg(base)
    trainer = Trainer(cfg, device=torch.device("cpu"))
    return run_steps(trainer, cfg.training.steps), trainer.full_state_dict()


def run_layouts(base: dict[str, Any], layouts: list[dict[str, Any]], world: int, timeout_s: float = 500) -> dict[str, Any]:
    """{layout name: {"losses": [...], "weights": {...}}} from rank 0 of each layout."""
    return run_many([(base, layouts)], world, timeout_s)


def run_many(runs: list[tuple[dict[str, Any], list[dict[str, Any]]]], world: int, timeout_s: float = 500) -> dict[str, Any]:
    """Several (base config, layouts) groups in one launch of `world` ranks."""
    payload = {"runs": [{"base": b, "layouts": lays} for b, lays in runs]}
    return launch("tests.parallel.layout_parity:parity_many", world, payload, timeout_s=timeout_s)[0]


def check_parity(got: dict[str, Any], ref: tuple[list[float], dict[str, torch.Tensor]], name: str) -> None:
    ref_losses, ref_weights = ref
    losses = got["losses"]
    assert len(losses) == len(ref_losses) >= 10, f"{name}: ran {len(losses)} steps"
    err = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
    assert err <= LOSS_TOL, f"{name}: loss differs by {err:.2e}\n{losses}\n{ref_losses}"
    weights = got["weights"]
    assert set(weights) == set(ref_weights), f"{name}: parameter names differ: {set(weights) ^ set(ref_weights)}"
    for key, value in ref_weights.items():
        torch.testing.assert_close(weights[key], value, atol=WEIGHT_TOL, rtol=0, msg=f"{name}: {key}")
