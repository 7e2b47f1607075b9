"""The job store's PostgreSQL restarted mid-job (a private server): while it is down the API answers
503 with Retry-After (never 500), a supervisor-like writer in another process keeps retrying and
loses nothing, and SDK and CLI calls made during the outage succeed once the store is back."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from typer.testing import CliRunner

from api.app import create_app
from api.cli import app as cli
from api.client import Client
from api.server import BackgroundServer
from service.spec import parse_spec
from service.store import JobStore
from tests.service.private_pg import private_postgres

ROOT = Path(__file__).resolve().parents[2]
STEPS = 60
# What a supervisor does from its own process: status, a metrics row and an event a step, a checkpoint.
WRITER = f"""
import sys, time
from service.store import JobStore
store = JobStore(sys.argv[1], run_migrations=False, write_retry_s=60)
job = sys.argv[2]
store.set_status(job, "RUNNING")
for step in range(1, {STEPS} + 1):
    store.add_metrics(job, [{{"step": step, "loss": 1.0 / step}}])
    store.add_event(job, "step", f"step {{step}}")
    print(step, flush=True)
    time.sleep(0.05)
store.add_checkpoint(job, {STEPS}, "file:///tmp/ckpt", "persistent")
store.set_status(job, "SUCCEEDED")
print("done", flush=True)
"""


def test_postgres_restart_mid_job_loses_nothing() -> None:
    with private_postgres() as pg:
        store = JobStore(pg.url, api_write_retry_s=1.0)
        token = store.create_token("alice", "user")
        server = BackgroundServer(create_app(store, None, cluster_total={"CPU": 8.0})).start()
        writer = None
        try:
            job, _ = store.create_job(parse_spec({"name": "through-a-restart"}), "alice", min_world=1, max_world=1)
            writer = subprocess.Popen([sys.executable, "-c", WRITER, pg.url, job.id], cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            assert writer.stdout is not None
            while int(writer.stdout.readline().strip() or 0) < 10:  # mid-job: ten steps written
                pass
            auth = {"Authorization": f"Bearer {token}"}
            pg.stop()
            t_down = time.monotonic()
            r = httpx.get(f"{server.url}/v1/jobs/{job.id}", headers=auth, timeout=30)
            assert r.status_code == 503, r.text
            assert r.headers["Retry-After"] == "2" and r.json()["error"] == "store_unavailable"
            r = httpx.post(f"{server.url}/v1/jobs", headers=auth, json={"name": "while-down"}, timeout=30)
            assert r.status_code == 503, r.text
            r = httpx.get(f"{server.url}/readyz", timeout=30)
            assert r.status_code == 503

            # The SDK retries the 503 (after Retry-After) until the store is back.
            seen: dict[str, object] = {}

            def sdk_call() -> None:
                with Client(server.url, token, retry_s=60) as c:
                    seen["job"] = c.get(job.id)
                    seen["new"] = c.submit({"name": "after-the-restart"})

            def cli_call() -> None:  # the CLI is the SDK's client: it waits out the 503s too
                seen["cli"] = CliRunner().invoke(cli, ["status", job.id],
                                                 env={"UNBROKEN_URL": server.url, "UNBROKEN_TOKEN": token})

            calls = [threading.Thread(target=sdk_call), threading.Thread(target=cli_call)]
            for t in calls:
                t.start()
            time.sleep(max(0.0, 3.0 - (time.monotonic() - t_down)))
            pg.start()
            for t in calls:
                t.join(60)
            assert "new" in seen, "the SDK did not get through after the restart"
            cli_result = seen["cli"]
            assert cli_result.exit_code == 0 and job.id in cli_result.output, cli_result.output
            out, err = writer.communicate(timeout=120)
            assert writer.returncode == 0 and out.strip().endswith("done"), err[-2000:]
            assert "unavailable" in err or "retrying" in err  # it did wait out the outage

            final = store.get_job(job.id)
            assert final is not None and final.status == "SUCCEEDED"
            steps = [m["step"] for m in store.metrics(job.id)]
            assert sorted(set(steps)) == list(range(1, STEPS + 1)), "a metrics row was lost"
            assert len(steps) == STEPS, "a metrics row was written twice"
            step_events = [e for e in store.events(job.id) if e.kind == "step"]
            assert len(step_events) == STEPS
            assert [c.step for c in store.checkpoints(job.id)] == [STEPS]
            names = {j.name for j in store.list_jobs(owner="alice")[0]}
            assert names == {"through-a-restart", "after-the-restart"}  # the 503'd submit stored nothing
        finally:
            if writer is not None and writer.poll() is None:
                writer.kill()
            server.stop()
            store.close()
