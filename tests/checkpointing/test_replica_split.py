"""A snapshot of a replicated layout stores each replicated chunk once, split among its replicas, and
restores bit for bit into the same layout and into another (tests.checkpointing.replica_split_ranks)."""

from __future__ import annotations

from pathlib import Path

from tests.checkpointing.harness import run_ranks


def test_replicas_split_their_snapshot_and_it_restores_whole(tmp_path: Path) -> None:
    run_ranks("tests.checkpointing.replica_split_ranks", 4, [], {}, timeout_s=300, log_dir=tmp_path / "logs")
    out = (tmp_path / "logs" / "rank0.log").read_text()
    for name in ("hsdp 2x2", "replicate 4", "fsdp 2 x tp 2"):
        assert f"OK {name} -> {{'dp_shard': 4}}: restored equal" in out, out[-3000:]
    assert "OK hsdp 2x2 -> {'dp_replicate': 2, 'dp_shard': 2}: restored equal" in out, out[-3000:]
    assert "OK replicate 4 -> {'dp_replicate': 4, 'dp_shard': 1}: restored equal" in out, out[-3000:]
    assert "OK fsdp 2 x tp 2 -> {'dp_shard': 2, 'tp': 2}: restored equal" in out, out[-3000:]
