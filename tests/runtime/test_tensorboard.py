"""workers/tensorboard.py: what it writes is read back by TensorBoard's own event reader."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from workers.metrics_log import MetricsLog, metrics_line  # noqa: E402
from workers.tensorboard import SCALARS, TensorBoardLog, write_from_metrics_file  # noqa: E402


@dataclass
class Step:
    step: int
    loss: float
    tokens: int
    dp: int
    world_size: int
    step_time_s: float
    tokens_per_s: float
    lr: float
    grad_norm: float
    peak_mem_bytes: int
    mfu: float | None


def steps(n: int) -> list[Step]:
    return [Step(step=i, loss=5.0 / i, tokens=4096, dp=4 if i < 3 else 3, world_size=4, step_time_s=0.01 * i,
                 tokens_per_s=1000.0 * i, lr=1e-3 * i, grad_norm=0.5 + i, peak_mem_bytes=1, mfu=None)
            for i in range(1, n + 1)]


def read(log_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def values(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_steps_and_recoveries_read_back(tmp_path: Path) -> None:
    ss = steps(5)
    with TensorBoardLog(tmp_path / "tb") as tb:
        for s in ss:
            tb.log_step(s, dp=s.dp, generation=0 if s.step < 3 else 1)
        tb.log_recovery(3, 1, "node_lost", "dp 4 -> 3")
    acc = read(tmp_path / "tb")
    tags = set(acc.Tags()["scalars"])
    # No MFU on CPU and no eval set here: no made-up series.
    assert tags == set(SCALARS.values()) - {"perf/mfu", "eval/loss", "eval/perplexity"}
    assert values(acc, "train/loss") == [(s.step, pytest.approx(s.loss)) for s in ss]
    assert values(acc, "train/lr") == [(s.step, pytest.approx(s.lr)) for s in ss]
    assert values(acc, "train/grad_norm") == [(s.step, pytest.approx(s.grad_norm)) for s in ss]
    assert values(acc, "perf/tokens_per_s") == [(s.step, pytest.approx(s.tokens_per_s)) for s in ss]
    assert values(acc, "elastic/dp_degree") == [(1, 4), (2, 4), (3, 3), (4, 3), (5, 3)]
    assert values(acc, "elastic/generation") == [(1, 0), (2, 0), (3, 1), (4, 1), (5, 1)]
    (text,) = acc.Tensors("elastic/events/text_summary")
    assert text.step == 3 and b"node_lost" in text.tensor_proto.string_val[0]


def test_from_metrics_file(tmp_path: Path) -> None:
    ss = steps(4)
    with MetricsLog(tmp_path / "run" / "metrics.jsonl") as log:
        for s in ss:
            log.write(metrics_line(s, generation=2))
    assert write_from_metrics_file(tmp_path / "run", tmp_path / "tb") == 4
    acc = read(tmp_path / "tb")
    assert values(acc, "train/loss") == [(s.step, pytest.approx(s.loss)) for s in ss]
    assert values(acc, "elastic/generation") == [(s.step, 2.0) for s in ss]
