"""`unbroken run job.yaml`: an embedded cluster, a worker killed at step 3, events streamed, exit 0;
then `unbroken export-hf` of the job's last persistent checkpoint (written by 3 ranks after the
recovery) equals the final state the job wrote."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from service.local_cluster import KEEP_RAY_LOGS_ENV
from tests.runtime.jobs import TINY_MODEL

REPO = Path(__file__).resolve().parents[2]


def test_unbroken_run_recovers_and_streams_events(tmp_path: Path) -> None:
    job = {
        "name": "cli-run",
        "model": TINY_MODEL,
        "training": {"steps": 6, "seq_len": 16, "global_batch_size": 8, "output_dir": "out"},
        "parallelism": {"dp_shard": 4},
        "resources": {"cpus_per_worker": 0.5},
        "fault_tolerance": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 20},
        "checkpoint": {"persist_every": 3},
        "chaos": [{"kind": "kill_worker", "step": 3, "rank": 3}],
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", "from api.cli import main; main()", "run", "job.yaml", "--num-cpus", "2",
         "--no-progress"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for kind in ("started", "failure_detected", "resized", "recovered", "finished", "released"):
        assert kind in proc.stderr, (kind, proc.stderr[-3000:])
    assert "SUCCEEDED" in proc.stderr
    ray_dir = re.search(r"an embedded Ray cluster; its logs in (\S+)", proc.stderr)
    assert ray_dir and not Path(ray_dir.group(1)).exists(), proc.stderr[-3000:]  # a success leaves no logs
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["dp"] for r in rows] == [4, 4, 4, 3, 3, 3]

    # The checkpoint of step 6 (dp=3, uneven FSDP shards) records its config: export needs nothing else.
    ckpts = (tmp_path / "out" / "checkpoints").as_uri()
    proc = subprocess.run([sys.executable, "-c", "from api.cli import main; main()", "export-hf", ckpts, "hf"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    import torch
    from safetensors.torch import load_file

    from parallel.hf import load_hf_state_dict

    exported, _ = load_hf_state_dict(str(tmp_path / "hf"))
    final = load_file(str(tmp_path / "out" / "final" / "model.safetensors"))
    assert exported.keys() == final.keys()
    for k in final:
        assert torch.equal(exported[k], final[k]), k


def test_unbroken_run_keeps_rays_logs_of_a_failed_job(tmp_path: Path) -> None:
    job = {"name": "cli-fails", "model": TINY_MODEL,
           "training": {"steps": 4, "seq_len": 16, "global_batch_size": 8, "output_dir": "out"},
           "data": {"kind": "text", "path": str(tmp_path / "nowhere.txt")},  # the start-up check fails the job
           "parallelism": {"dp_shard": 2}, "resources": {"cpus_per_worker": 0.5}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop(KEEP_RAY_LOGS_ENV, None)
    proc = subprocess.run([sys.executable, "-c", "from api.cli import main; main()", "run", "job.yaml",
                           "--num-cpus", "2", "--no-progress"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    kept = re.search(r"Ray's logs \(the workers' own output among them\): (\S+)/session_latest/logs", proc.stderr)
    try:
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "FAILED" in proc.stderr and "data.path=" in proc.stderr, proc.stderr[-3000:]
        assert kept and Path(kept.group(1), "session_latest", "logs").is_dir(), proc.stderr[-3000:]
    finally:
        if kept:
            shutil.rmtree(kept.group(1), ignore_errors=True)


def test_unbroken_run_refuses_a_bad_job_file(tmp_path: Path) -> None:
    (tmp_path / "job.yaml").write_text("resources: {dp: {min: 3, max: 2}}\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", "from api.cli import main; main()", "run", "job.yaml"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "dp.max=2 is below dp.min=3" in proc.stderr
