"""Predicted peak memory per rank against what the local launcher measures on CPU (peak RSS).

Two real 2-rank runs (tiny: baseline-dominated; small: activations about half the peak) must
land within 25% of the planner's CPU-preset estimate. Step times are not asserted (the CPU is
shared); tests/benchmarks/planner_bench.py compares the ranking of layouts.
"""

from __future__ import annotations

import pytest

from tests.benchmarks.planner_bench import Case, compare, job

CASES = [
    Case("tiny fsdp2", 2, job("tiny", {"dp_shard": 2}, steps=3, seq_len=64, batch=8)),
    Case("small fsdp2", 2, job("small", {"dp_shard": 2}, steps=3, seq_len=256, batch=8)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_predicted_peak_memory_within_25_percent(case: Case) -> None:
    row = compare(case)
    assert 0.75 <= row["memory_ratio"] <= 1.25, row
