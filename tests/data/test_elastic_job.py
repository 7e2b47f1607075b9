"""Batch invariance with real data and evaluation, through the supervisor: a 4-worker job on prepared
tokens (document masks, a held-out split evaluated every 5 steps) loses a worker at step 3, shrinks to 3
and grows back to 4; every step's train loss and every eval loss equal the uninterrupted run's (one
process, fp32, <= 1e-4)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from parallel.config import DataConfig
from parallel.data.prepare import prepare_dataset
from parallel.data.tokenizer import load_tokenizer
from parallel.trainer import Trainer
from tests.runtime.conftest import make_cluster
from tests.runtime.jobs import JobRun, assert_no_leaks, engine_of, paced, tiny_spec

STEPS = 40
# Every rank sleeps before each step (as tests/runtime/test_nodes.py): time for a replacement to start.
SLOW = paced(4, 0.3)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """One node with room for exactly four 0.5-CPU workers (a fifth cannot start until one is gone)."""
    yield from make_cluster(2, {})


def _spec(out: Path, prepared: Path, chaos: list[dict[str, Any]]) -> Any:
    from service.spec import parse_spec

    raw = tiny_spec(out, steps=STEPS, chaos=chaos).model_dump(mode="json")
    raw["data"] = {"kind": "tokens", "path": str(prepared), "document_mask": True, "seed": 3,
                   "eval": {"split": 0.1, "sequences": 12}}
    raw["training"]["eval_every"] = 5
    return parse_spec(raw)


def test_shrink_and_grow_keep_train_and_eval_losses(cluster: Any, tmp_path: Path) -> None:
    words = ["packed", "windows", "keep", "documents", "apart", "while", "workers", "come", "and", "go"]
    with (tmp_path / "docs.jsonl").open("w") as f:
        for i in range(600):
            f.write(json.dumps({"text": " ".join(words[(i + k) % 10] for k in range(i % 6 + 1))}) + "\n")
    prepare_dataset(DataConfig(kind="jsonl", path=str(tmp_path / "docs.jsonl")), tmp_path / "prepared",
                    load_tokenizer(None))
    spec = _spec(tmp_path / "job", tmp_path / "prepared", [*SLOW, {"kind": "kill_worker", "step": 3, "rank": 1}])
    run = JobRun(spec)
    try:
        run.wait(timeout_s=600)
    finally:
        run.finish()
    assert run.status["state"] == "SUCCEEDED", run.events
    dps = [(e["data"]["old_dp"], e["data"]["new_dp"]) for e in run.of("resized")]
    assert dps[0] == (4, 3) and dps[-1][1] == 4, dps
    rows = run.rows()
    assert {r["dp"] for r in rows} == {3, 4}

    one = engine_of(spec)
    one.parallelism.dp_shard = -1  # the same job in this one process
    ref_trainer = Trainer(one, device=torch.device("cpu"))
    ref = [ref_trainer.train_step() for _ in range(STEPS)]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert max(abs(r["loss"] - m.loss) for r, m in zip(rows, ref, strict=True)) <= 1e-4
    evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    want = {m.step: m.eval_loss for m in ref if m.eval_loss is not None}
    assert sorted(evals) == sorted(want) == list(range(5, STEPS + 1, 5))
    assert max(abs(evals[s] - v) for s, v in want.items()) <= 1e-4
    assert_no_leaks(run.job_id)
