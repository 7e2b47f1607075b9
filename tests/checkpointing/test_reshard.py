"""Save at world 4 (FSDP 4 to S3; FSDP 2 x TP 2 to file://), restore at worlds 2, 3 and 4: the full
gathered state is identical and the next step's loss matches the uninterrupted run. With the
engine's Trainer: FSDP 4 saved mid-run, restored at worlds 2 and 3, and FSDP 2 x TP 2 restored at
dp 1 x tp 2: the next 10 steps match the uninterrupted run.

One launch of 4 processes runs every phase (the groups re-form in the same processes).
"""

from __future__ import annotations

from pathlib import Path

from checkpointing.local_s3 import LocalS3Server
from tests.checkpointing.harness import run_ranks


def test_save_world4_restore_world_2_3_4(tmp_path: Path, s3_server: LocalS3Server, s3_bucket: str) -> None:
    env = {"UB_S3_ENDPOINT": s3_server.endpoint_url, "UB_S3_KEY": s3_server.access_key,
           "UB_S3_SECRET": s3_server.secret_key, "UB_S3_BUCKET": s3_bucket}  # fmt: skip
    run_ranks(
        "tests.checkpointing.reshard_ranks", 4, [str(tmp_path)], env, timeout_s=420, log_dir=tmp_path / "logs"
    )
    out = (tmp_path / "logs" / "rank0.log").read_text()
    for layout, worlds in (("fsdp", (2, 3, 4)), ("fsdp_tp", (2, 4))):
        for w in worlds:
            assert f"OK {layout} 4->{w}:" in out, out[-2000:]
    for tp, w in ((1, 2), (1, 3), (2, 2)):
        assert f"OK trainer tp{tp} 4->{w}: 10 steps match" in out, out[-2000:]
