"""The head container's script from deploy/kuberay/raycluster.yaml, run for real on this machine.

KubeRay runs it as `/bin/bash -lc -- SCRIPT` with $KUBERAY_GEN_RAY_START_CMD set to its
`ray start --head ... --block` line. Here the same script runs with a `ray start --head --block`
on private ports and temp dir; only addresses are changed (asserted below, so a change to the
script is noticed): the API on 127.0.0.1 and a free port, /tmp/ray -> this test's Ray temp dir.
The API must come up once Ray is up, with `--address auto` reaching this Ray (never another
cluster on the machine: it waits for this node's address file), Ray must stay the blocking
process, and the API must be restarted when it dies. Every process started is found by its session
id and stopped by PID at the end.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from examples.user_cluster import cmdline, session_pids
from tests.deploy.validation import REPO
from workers.ports import free_port

STARTUP_S = 240.0  # ray start + the API's imports on a loaded 2-core machine


def head_script() -> str:
    rc = next(d for d in yaml.safe_load_all((REPO / "deploy" / "kuberay" / "raycluster.yaml").read_text())
              if d and d["kind"] == "RayCluster")
    ctr = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert ctr["command"] == ["/bin/bash", "-lc", "--"] and len(ctr["args"]) == 1
    return str(ctr["args"][0])


def replace_once(s: str, old: str, new: str, n: int = 1) -> str:
    assert s.count(old) == n, f"the head script changed: expected {old!r} {n} time(s)"
    return s.replace(old, new)


def ours(sid: int, temp: str) -> set[int]:
    """Processes this test started: in the script's session, or Ray processes using its temp dir."""
    return set(session_pids(sid)) | {int(p) for p in os.listdir("/proc") if p.isdigit() and temp in cmdline(int(p))}


def stop_ours(sid: int, temp: str) -> None:
    """SIGTERM, then SIGKILL, each round re-reading which PIDs are still ours (no PID-reuse accidents)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in ours(sid, temp):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, sig)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and ours(sid, temp):
            time.sleep(0.3)


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def ray_logs(temp: Path) -> str:
    out = []
    for name in ("raylet.out", "raylet.err", "gcs_server.err"):
        for f in temp.glob(f"session_2*/logs/{name}"):
            lines = f.read_text(errors="replace").splitlines()
            bad = [ln for ln in lines if re.search(r"Check failed|\] F |\bE \d|[Ee]rror", ln)]
            out.append(f"--- {f}\n" + "\n".join(bad[:15] or lines[-15:]))
    return "\n".join(out)


def log_temp(log: Path) -> Path:
    return Path(log.parent.joinpath("cmd").read_text().split("=", 1)[1])


def wait_for(cond, timeout: float, what: str, proc: subprocess.Popen[bytes], log: Path) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        if proc.poll() is not None:
            break
        time.sleep(1.0)
    text = log.read_text(errors="replace")
    if "The current node timed out during startup" in text or "Failed to get node info" in text:
        # Ray's own `ray start` failed (its raylet crashes now and then on this loaded 2-core
        # machine, node_manager.cc CHECK): nothing about the script was tested.
        pytest.skip(f"Ray's head node did not start here: {ray_logs(log_temp(log))[-500:]}")
    temp = next((Path(t.split("=", 1)[1]) for t in log.parent.joinpath("cmd").read_text().split()
                 if t.startswith("--temp-dir=")), None)
    pytest.fail(f"{what} (script exit {proc.poll()}); log tail:\n{log.read_text(errors='replace')[-3000:]}\n"
                f"{ray_logs(temp) if temp else ''}")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_head_script_runs_api_beside_ray(tmp_path: Path) -> None:
    gcs, api = free_port(), free_port()
    script = head_script()
    script = replace_once(script, "--host 0.0.0.0 --port 8420", f"--host 127.0.0.1 --port {api}")
    # Ray's default temp dir is $RAY_TMPDIR/ray: `ray start` writes ray_current_cluster there once
    # the node is up, and `--address auto` reads it, as /tmp/ray in the pod.
    tmpdir = Path(f"/tmp/ubhead-{os.getpid()}-{gcs}")
    temp = tmpdir / "ray"
    script = replace_once(script, "/tmp/ray/ray_current_cluster", f"{temp}/ray_current_cluster", n=2)
    ray_start = " ".join([
        "ray start --head --block --disable-usage-stats", f"--port={gcs}", "--num-cpus=0",
        "--include-dashboard=false", "--object-store-memory=100000000",
        f"--ray-client-server-port={free_port()}", f"--metrics-export-port={free_port()}",
        f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
        f"--runtime-env-agent-port={free_port()}", "--node-ip-address=127.0.0.1",
    ])
    env = {
        **os.environ,
        "KUBERAY_GEN_RAY_START_CMD": ray_start,
        "RAY_TMPDIR": str(tmpdir),  # `--address auto` finds this cluster, not another on the machine
        "UNBROKEN_DB": f"sqlite:///{tmp_path / 'unbroken.db'}",
        "UNBROKEN_HOME": str(tmp_path / "home"),
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        # A fresh pod has no ~/.ray/auth_token, so Ray's token auth is off there; this machine may
        # have one from other clusters: turn it off explicitly for the same behaviour.
        "RAY_AUTH_MODE": "disabled",
        "OMP_NUM_THREADS": "1",
    }
    # The image has the `unbroken` entry point (test_dockerfile checks the wheel); this checkout may not.
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "unbroken").write_text(f'#!/bin/sh\nexec "{sys.executable}" -c "import sys; from api.cli import main; '
                                    f'sys.argv[0] = \'unbroken\'; main()" "$@"\n')
    (shims / "unbroken").chmod(0o755)
    env["PATH"] = f"{shims}:{env['PATH']}"
    env["PYTHONPATH"] = f"{REPO}:{env.get('PYTHONPATH', '')}"
    log = tmp_path / "head.log"
    (tmp_path / "cmd").write_text(f"--temp-dir={temp}")
    url = f"http://127.0.0.1:{api}"
    with log.open("wb") as out:
        # `bash -c` rather than KubeRay's `bash -lc`: a login shell here would reset PATH to the system's.
        proc = subprocess.Popen(["/bin/bash", "-c", "--", script], env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_for(lambda: healthy(url), STARTUP_S, "the API did not come up", proc, log)
        text = log.read_text(errors="replace")
        assert "Ray at auto" in text, text[-3000:]  # the server connected to a running Ray, not an embedded one
        mine = f"Connecting to existing Ray cluster at address: 127.0.0.1:{gcs}"
        assert mine in text and text.count("Connecting to existing Ray cluster") == 1, text[-3000:]
        assert proc.poll() is None  # `ray start --block` is still the foreground process
        serve = [p for p in session_pids(proc.pid)  # the python process of the `unbroken` shim
                 if "from api.cli import main" in cmdline(p) and " serve --address auto" in cmdline(p)
                 and not cmdline(p).startswith(("/bin/sh", "/bin/bash"))]
        assert len(serve) == 1, [cmdline(p) for p in session_pids(proc.pid)]
        os.kill(serve[0], signal.SIGKILL)
        wait_for(lambda: "unbroken serve exited" in log.read_text(errors="replace"), 60, "no restart message", proc,
                 log)
        wait_for(lambda: healthy(url) and not Path(f"/proc/{serve[0]}").exists(), STARTUP_S,
                 "the API did not come back after it was killed", proc, log)
        assert proc.poll() is None
        text = log.read_text(errors="replace")
        assert text.count(mine) == 2 and text.count("Connecting to existing Ray cluster") == 2, text[-3000:]
    finally:
        stop_ours(proc.pid, str(tmpdir))
        proc.wait(timeout=10)
        subprocess.run(["rm", "-rf", str(tmpdir)], check=False)
