"""Persistent-checkpoint benchmark: prints two ratios (medians of a few rounds, one process).

(2) blocking: how long the training thread is held by `CheckpointManager.save_async` (a host copy
    into reused buffers) over a synchronous `torch.save` of the same state to local disk.
    Goal <= 0.05.
(3) bandwidth: bytes/s of our whole persistent save to S3 (planning, parallel multipart upload
    with SHA-256, metadata, manifest) over a plain boto3 `upload_fileobj` multipart upload of the
    same bytes with the same part size and concurrency to the same local SeaweedFS. Goal >= 0.8.

Run: .venv/bin/python -m tests.benchmarks.checkpoint_bench [--model small] [--rounds 3]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from checkpointing.config import CheckpointConfig
from checkpointing.local_s3 import LocalS3Server
from checkpointing.persistent import CheckpointManager
from parallel.config import ModelConfig
from parallel.model import build_model, init_weights


def make_state(preset: str) -> dict[str, Any]:
    cfg = ModelConfig(preset=preset)
    model = build_model(cfg, "cpu")
    init_weights(model, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 33))
    model(tokens[:, :-1]).float().mean().backward()
    opt.step()  # materialises exp_avg / exp_avg_sq
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "step": 1}


def nbytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(nbytes(v) for v in state.values())
    return 0


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", help="model preset for the state (default: small)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    state = make_state(args.model)
    size = nbytes(state)
    print(f"checkpoint bench: model={args.model}, state {size / 2**20:.1f} MiB, {args.rounds} rounds")

    with (
        tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmp,
        LocalS3Server(Path(tmp) / "weed") as server,
    ):
        server.create_bucket("bench")
        cfg = CheckpointConfig(uri="s3://bench/run", s3=server.s3_config(), keep_last=2)
        mgr = CheckpointManager(cfg, "unused", rank=0, world_size=1)
        mgr.save(state, 0, 0, {})  # warm-up: allocates the reused staging buffers, opens connections

        sync_s, block_s, ours_bw, plain_bw = [], [], [], []
        client = mgr.store.client
        for r in range(1, args.rounds + 1):
            path = Path(tmp) / "sync.pt"
            t0 = time.perf_counter()
            torch.save(state, path)
            sync_s.append(time.perf_counter() - t0)
            path.unlink()

            handle = mgr.save_async(state, r, 0, {})
            block_s.append(handle.blocking_s)
            res = handle.result()
            assert res.ok, res.error
            total = next(i for i in mgr.list() if i.step == r).total_bytes
            ours_bw.append(total / res.upload_s)

            payload = client.get_object(Bucket="bench", Key=f"run/step-{r:08d}/__0_0.distcp")["Body"].read()
            t0 = time.perf_counter()
            client.upload_fileobj(io.BytesIO(payload), "bench", f"plain/{r}", Config=mgr.store.transfer)
            plain_bw.append(len(payload) / (time.perf_counter() - t0))
            client.delete_object(Bucket="bench", Key=f"plain/{r}")
        mgr.close()

    med = statistics.median
    blocking_ratio = med(block_s) / med(sync_s)
    bw_ratio = med(ours_bw) / med(plain_bw)
    print(
        f"  torch.save (sync, local disk): {med(sync_s) * 1e3:.1f} ms; save_async blocking: {med(block_s) * 1e3:.1f} ms"
    )
    print(f"(2) async-save blocking / sync torch.save = {blocking_ratio:.3f}  (goal <= 0.05)")
    print(
        f"  our save to S3: {med(ours_bw) / 1e6:.1f} MB/s; plain boto3 multipart: {med(plain_bw) / 1e6:.1f} MB/s"
    )
    print(f"(3) our upload bandwidth / plain boto3 multipart = {bw_ratio:.3f}  (goal >= 0.8)")
    return {"blocking_ratio": blocking_ratio, "bandwidth_ratio": bw_ratio}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
