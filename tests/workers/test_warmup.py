"""What a worker forked from its node's zygote still pays: the zygote runs workers.warmup.import_engine
before it forks, so a child's warm-up (the job's data, its model built on the meta device, one step)
must not import anything big of its own. It did: the model's first parameter init imported
torch._dynamo (~200 modules, 0.35-0.55 CPU-s), about half of a forked replacement's start-up CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import json, sys
from workers.warmup import import_engine, warm_up
import_engine()
import torch, yaml
from service.spec import parse_spec
from tests.runtime.jobs import engine_of
spec = yaml.safe_load(open("examples/demo_job.yaml"))
spec.get("checkpoint", {}).pop("s3", None)
spec["data"] = {"kind": "synthetic"}
cfg = engine_of(parse_spec(spec))
before = set(sys.modules)
warmed = warm_up(cfg, torch.device("cpu"))
print(json.dumps({"warmed": warmed, "new": sorted(set(sys.modules) - before)}))
"""


def test_warm_up_after_import_engine_imports_next_to_nothing() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["warmed"] == {"step": True}, got["warmed"]
    assert "torch._dynamo" not in got["new"], "the warm-up imported torch._dynamo: import_engine should have"
    # (torch.profiler._cupti_monitor, one small module, is imported by the first step on torch 2.13)
    assert len(got["new"]) <= 3, f"the warm-up imported modules import_engine did not: {got['new']}"


def test_open_checkpoint_store_leaves_the_client_the_tiers_use() -> None:
    """A worker opens its job's checkpoint store while it warms up: the first S3 client in a process cost
    0.27-0.29 s of CPU, which a worker joining a later generation (a grow-back, a spare) paid between the
    rendezvous and the restore, with every other rank waiting for it. The tiers must then get that client."""
    from checkpointing import storage_s3
    from checkpointing.config import CheckpointConfig
    from checkpointing.uri import open_store
    from workers.warmup import open_checkpoint_store

    ckpt = CheckpointConfig.model_validate(
        {"uri": "s3://warm-bucket/job-1", "s3": {"endpoint_url": "http://127.0.0.1:9/open-checkpoint-store"}}
    )
    before = dict(storage_s3._clients)
    assert open_checkpoint_store(ckpt, str(ckpt.uri)) is None
    made = [c for k, c in storage_s3._clients.items() if k not in before]
    assert len(made) == 1, "the warm-up made no S3 client (or more than one)"
    # The generation's CheckpointManager opens the same store with the same settings: no new client.
    assert open_store(str(ckpt.uri), ckpt.s3).client is made[0]  # type: ignore[attr-defined]
    assert len(storage_s3._clients) == len(before) + 1


def test_open_checkpoint_store_says_why_it_could_not() -> None:
    from checkpointing.config import CheckpointConfig
    from workers.warmup import open_checkpoint_store

    # A region botocore refuses (the spec leaves its format to botocore): the warm-up says so, and goes on.
    ckpt = CheckpointConfig.model_validate({"uri": "s3://warm-bucket/job-2", "s3": {"region": "bad region!"}})
    why = open_checkpoint_store(ckpt, str(ckpt.uri))
    assert why is not None and "InvalidRegionError" in why and "bad region!" in why, why
