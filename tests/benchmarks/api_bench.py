"""Control-plane benchmark: submit, get and list latency (p50/p99) and requests/s with 10,000
stored jobs in SQLite, through a real `unbroken serve --no-ray` process over HTTP.

Goal: p99 <= 50 ms for get and list (a page of 50).

Run: .venv/bin/python -m tests.benchmarks.api_bench [--jobs 10000] [--requests 500] [--threads 8]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from sqlalchemy import insert

from service.models import Event, Job
from service.spec import parse_spec
from service.store import JobStore, new_job_id, spec_to_private_json
from workers.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
TINY = {"name": "bench", "model": {"preset": "tiny"}, "training": {"steps": 10}}


def populate(store: JobStore, n: int, owners: int = 10) -> list[str]:
    """Insert n jobs (specs stored as the API stores them) in bulk, spread over `owners` users."""
    spec = parse_spec(TINY)
    private = spec_to_private_json(spec)
    public = json.dumps(spec.public_dict())
    now = time.time()
    ids = [new_job_id() for _ in range(n)]
    statuses = ["SUCCEEDED", "FAILED", "CANCELLED", "PENDING", "RUNNING"]
    rows = [
        dict(id=jid, name=f"bench-{i % 100}", owner=f"user{i % owners}", status=statuses[i % len(statuses)],
             reason=None, priority=i % 3, spec_json=private, spec_public=public, spec_hash="x" * 64,
             idempotency_key=None, min_world=1, max_world=4, created_at=now + i * 1e-3, updated_at=now,
             cancel_requested=False, recoveries=0, progress={"step": i % 10, "loss": 3.0})
        for i, jid in enumerate(ids)
    ]
    with store.engine.begin() as conn:
        for k in range(0, n, 2000):
            conn.execute(insert(Job), rows[k:k + 2000])
            conn.execute(insert(Event), [dict(job_id=r["id"], ts=now, kind="submitted", message="bench", data=None)
                                         for r in rows[k:k + 2000]])
    return ids


def cpu_seconds(pid: int) -> float:
    """User+system CPU time of a process (Linux /proc): what the server spent, whatever the load."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


SERVER_PID = 0
CPU_PER_REQUEST: dict[int, float] = {}


def timed(fn: Callable[[], httpx.Response], n: int) -> list[float]:
    cpu0 = cpu_seconds(SERVER_PID)
    out = []
    for _ in range(n):
        t = time.perf_counter()
        r = fn()
        out.append(time.perf_counter() - t)
        if r.status_code >= 400:
            raise RuntimeError(f"{r.request.method} {r.request.url} -> {r.status_code}: {r.text[:300]}")
    CPU_PER_REQUEST[id(out)] = (cpu_seconds(SERVER_PID) - cpu0) / n
    return out


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def throughput(url: str, token: str, ids: list[str], threads: int, per_thread: int) -> float:
    def work(k: int) -> None:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as c:
            for i in range(per_thread):
                c.get(f"/v1/jobs/{ids[(k * per_thread + i) % len(ids)]}").raise_for_status()

    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return threads * per_thread / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--jobs", type=int, default=10000)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--threads", type=int, default=8)
    args = ap.parse_args([] if argv is None else argv)  # main() alone: the defaults (run_all calls it so)

    load0 = f"{os.getloadavg()[0]:.1f}"
    home = Path(tempfile.mkdtemp(prefix="unbroken-bench-"))
    db = f"sqlite:///{home / 'bench.db'}"
    store = JobStore(db)
    t0 = time.perf_counter()
    ids = populate(store, args.jobs)
    admin = store.create_token("bench-admin", "admin")
    user_token = store.create_token("user3", "user")
    print(f"stored {args.jobs} jobs in {time.perf_counter() - t0:.1f} s ({db})")
    store.close()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-c", "from api.cli import main; main()", "serve", "--no-ray", "--db", db, "--port", str(port)],
        cwd=ROOT, env={**os.environ, "UNBROKEN_HOME": str(home)}, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )
    global SERVER_PID
    SERVER_PID = proc.pid
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the API server did not start")
            time.sleep(0.2)
        h = {"Authorization": f"Bearer {admin}"}
        with httpx.Client(base_url=url, headers=h, timeout=30) as c, \
                httpx.Client(base_url=url, headers={"Authorization": f"Bearer {user_token}"}, timeout=30) as u:
            timed(lambda: c.get("/v1/jobs"), 20)  # warm up
            n = args.requests
            k = iter(range(10**9))
            rows = {
                "submit (POST /v1/jobs)": timed(lambda: c.post("/v1/jobs", json=TINY), max(50, n // 5)),
                "get (GET /v1/jobs/{id})": timed(lambda: c.get(f"/v1/jobs/{ids[next(k) % len(ids)]}"), n),
                "list, admin, 50/page": timed(lambda: c.get("/v1/jobs", params={"limit": 50}), n),
                "list, one user, 50/page": timed(lambda: u.get("/v1/jobs", params={"limit": 50}), n),
                "list, status filter": timed(lambda: c.get("/v1/jobs", params={"status": "RUNNING"}), n),
            }
            cursor = c.get("/v1/jobs", params={"limit": 50}).json()["next_cursor"]
            rows["list, page 2 (cursor)"] = timed(
                lambda: c.get("/v1/jobs", params={"limit": 50, "cursor": cursor}), n)
        rps = throughput(url, admin, ids, args.threads, max(50, n // 4))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(home, ignore_errors=True)

    print(f"\nAPI latency with {args.jobs} stored jobs (SQLite, HTTP to a local `unbroken serve --no-ray`)")
    print(f"load average before/after: {load0} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs "
          "(latency includes waiting for a CPU; 'server CPU ms' does not)")
    print(f"{'operation':<26} {'n':>5} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8} {'server CPU ms':>14}")
    for name, xs in rows.items():
        print(f"{name:<26} {len(xs):>5} {pct(xs, 0.5) * 1e3:>8.2f} {pct(xs, 0.99) * 1e3:>8.2f} "
              f"{statistics.mean(xs) * 1e3:>8.2f} {CPU_PER_REQUEST[id(xs)] * 1e3:>14.2f}")
    print(f"\nthroughput: {rps:.0f} requests/s (GET one job, {args.threads} client threads)")
    worst = max(pct(rows[r], 0.99) for r in rows if not r.startswith("submit"))
    print(f"goal: p99 of get and list <= 50 ms -> worst p99 {worst * 1e3:.1f} ms ({worst * 1e3 / 50:.2f} x the goal)")


if __name__ == "__main__":
    main(sys.argv[1:])
