"""step_gap_bench's last line: our fault-free step's gap to TorchFT's, split by what each variant removes."""

from __future__ import annotations

from tests.benchmarks.step_gap_bench import split_gap


def test_the_gap_splits_into_snapshots_layout_and_the_rest() -> None:
    means = {"torchft": 0.25, "shard": 0.45, "shard, no snapshot": 0.41, "replicate": 0.39, "replicate, no snap": 0.33}
    line = split_gap(means)
    assert line.startswith("step gap: ours 1.80x torchft (0.450 against 0.250 s)"), line
    # The three parts add up to the whole gap (0.20 s).
    assert "snapshots +0.040 s, FSDP against DDP +0.080 s, the rest of our worker +0.080 s" in line, line
