"""The per-node zygote (workers.zygote) and its client (workers.zygote_client), as Ray runs them: real
processes, a real fork, the client started the way a raylet starts a worker (`bash -c "exec CMD ARGS"`),
with a stand-in for Ray's default_worker.py that reports what it sees and exits with a chosen code."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import workers.zygote as workers_zygote
from workers.zygote import FORKED_ENV
from workers.zygote_client import _engine_source_stamp, command, env_key

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the zygote is Linux only")

WORKER = """
import json, os, signal, sys, time
print(json.dumps({"pid": os.getpid(), "pgid": os.getpgid(0), "forked": os.environ.get("FORKED_ENV"),
                  "x": os.environ.get("X"), "cwd": os.getcwd(), "argv": sys.argv[1:],
                  "torch": "torch" in sys.modules, "ray": "ray" in sys.modules,
                  "signals": [str(signal.getsignal(s)) for s in (signal.SIGPIPE, signal.SIGINT, signal.SIGTERM,
                                                                 signal.SIGCHLD)],
                  "path0": sys.path[0]}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if os.environ.get("SLEEP"):
    time.sleep(float(os.environ["SLEEP"]))
sys.exit(int(os.environ.get("CODE", "0")))
"""


@pytest.fixture
def worker_py(tmp_path: Path) -> Path:
    p = tmp_path / "default_worker.py"
    p.write_text(WORKER.replace('"FORKED_ENV"', repr(FORKED_ENV)))
    return p


def _start(cmd: str, worker_py: Path, cwd: Path, **env: str) -> subprocess.Popen[str]:
    args = f"{worker_py} --node-id=node1 --flag=1"
    full = {**os.environ, "RAY_RAYLET_PID": str(os.getpid()), **env}  # this test stands for the raylet
    return subprocess.Popen(["bash", "-c", f"exec {cmd} {args}"], cwd=cwd, env=full, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _run(cmd: str, worker_py: Path, cwd: Path, **env: str) -> tuple[int, dict[str, Any], str, int]:
    proc = _start(cmd, worker_py, cwd, **env)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, json.loads(out.splitlines()[0]), err, proc.pid


def _stop_zygote(pid: int) -> None:
    """The zygote the test's first client started (its pid, as its children report it)."""
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):  # (init reaps it: not our child)
        time.sleep(0.05)


def test_workers_are_forked_from_one_zygote_with_their_own_streams_env_and_group(
        worker_py: Path, tmp_path: Path) -> None:
    cmd = command(f"test-{uuid.uuid4().hex[:8]}")
    zygote = 0
    try:
        code, seen, err, client = _run(cmd, worker_py, tmp_path, X="first", CODE="7")
        zygote = int(seen["forked"])
        assert code == 7, err  # the child's status is the client's
        assert seen["pid"] != client and seen["pgid"] == seen["pid"], seen  # a group of its own
        assert seen["torch"] and seen["ray"], "the zygote imported torch and Ray's module before forking"
        assert (seen["x"], seen["cwd"], seen["argv"]) == ("first", str(tmp_path), ["--node-id=node1", "--flag=1"])
        assert seen["path0"] == str(worker_py.parent)  # as `python default_worker.py` would have it
        fresh = subprocess.run([sys.executable, str(worker_py)], capture_output=True, text=True, cwd=tmp_path)
        assert seen["signals"] == json.loads(fresh.stdout.splitlines()[0])["signals"], seen  # a fresh one's
        assert "to stderr" in err  # the client's own streams, handed over
        code2, seen2, _, _ = _run(cmd, worker_py, tmp_path, X="second")
        assert code2 == 0 and seen2["x"] == "second"
        assert int(seen2["forked"]) == zygote and seen2["pid"] != seen["pid"]  # the same zygote, a new child
    finally:
        if zygote:
            _stop_zygote(zygote)


def test_a_signal_to_the_client_reaches_its_worker(worker_py: Path, tmp_path: Path) -> None:
    cmd = command(f"test-{uuid.uuid4().hex[:8]}")
    proc = _start(cmd, worker_py, tmp_path, SLEEP="60")
    zygote = 0
    try:
        assert proc.stdout is not None
        seen = json.loads(proc.stdout.readline())
        zygote = int(seen["forked"])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert not os.path.exists(f"/proc/{seen['pid']}") or "Z" in Path(f"/proc/{seen['pid']}/stat").read_text()
    finally:
        proc.kill()
        if zygote:
            _stop_zygote(zygote)


def test_each_ray_job_gets_its_own_zygote(worker_py: Path, tmp_path: Path) -> None:
    """Ray's core library, loaded in the zygote before it forks, keeps the Ray job id it was loaded under:
    workers of another Ray job (the jobs of an `unbroken serve` started again) are forked from a zygote of
    their own, those of one Ray job share one."""
    cmd = command(f"test-{uuid.uuid4().hex[:8]}")
    zygotes: list[int] = []
    try:
        for job in ("01000000", "01000000", "03000000"):
            code, seen, err, _ = _run(cmd, worker_py, tmp_path, RAY_JOB_ID=job)
            assert code == 0 and seen["forked"], err
            zygotes.append(int(seen["forked"]))
        assert zygotes[0] == zygotes[1] != zygotes[2], zygotes
    finally:
        for z in set(zygotes):
            _stop_zygote(z)


def test_without_a_zygote_the_client_becomes_the_worker(worker_py: Path, tmp_path: Path) -> None:
    """A Python without our package cannot start a zygote: the client runs the worker itself (exec)."""
    system = shutil.which("python3", path="/usr/bin:/bin")
    if system is None or subprocess.run([system, "-c", "import workers"], cwd=tmp_path,
                                        capture_output=True).returncode == 0:
        pytest.skip("needs a system python3 without this package")
    code, seen, err, client = _run(command(f"test-{uuid.uuid4().hex[:8]}", python=system), worker_py,
                                   tmp_path, X="alone", CODE="3")
    assert code == 3, err
    assert seen["pid"] == client and seen["forked"] is None and not seen["torch"], seen
    assert seen["x"] == "alone"


def test_jobs_set_up_alike_share_a_key_and_others_do_not() -> None:
    """The key a job's workers ask for their node's zygote by (workers.zygote_client.env_key): the same for
    the same Python and environment in any order, another for any other value, variable or Python."""
    env = {"OMP_NUM_THREADS": "1", "HF_HOME": "/data/hf", "TOKEN": "s3cret"}
    key = env_key(env)
    assert key == env_key(dict(reversed(list(env.items()))))
    assert key != env_key({**env, "TOKEN": "other"})
    assert key != env_key({**env, "EXTRA": ""})
    assert key != env_key(env, python="/usr/bin/python3")
    assert "s3cret" not in key and key.startswith("env-")
    # and the engine's sources as they are on disk (a zygote never serves code older than the job's)
    stamp = _engine_source_stamp()
    warmup = Path(workers_zygote.__file__).with_name("warmup.py").stat()
    assert f"workers/warmup.py:{warmup.st_size}:{warmup.st_mtime_ns}" in stamp
    assert any(x.startswith("parallel/trainer.py:") for x in stamp) and any(x.startswith("checkpointing/") for x in stamp)
