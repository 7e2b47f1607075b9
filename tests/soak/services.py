"""The soak's world, started the way users start it, and the driver's faults on the service's own parts.

A private PostgreSQL (Debian's initdb/pg_ctl, a free port) as the job store; a SeaweedFS S3 server for
the persistent checkpoints; a Ray cluster started with `ray start` in the KubeRay layout (a head that
runs no Ray work, a control node `unbroken_control` for supervisors, worker nodes with spare capacity);
a real `unbroken serve` process. Everything is private to the soak and stopped by PID at the end.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

from checkpointing.local_s3 import LocalS3Server
from examples.user_cluster import RayStartCluster, Serve, cmdline, session_pids
from tests.service.private_pg import private_postgres

BUCKET = "soak"


class SoakServices:
    def __init__(self, root: Path, *, worker_nodes: int, cpus_per_node: int) -> None:
        self.root = root
        self.cpus_per_node = cpus_per_node
        self._stack = contextlib.ExitStack()
        self.pg: Any = None
        self.s3: LocalS3Server | None = None
        self.cluster: RayStartCluster | None = None
        self.serve: Serve | None = None
        self.worker_nodes = [f"w{i + 1}" for i in range(worker_nodes)]
        self._next_node = worker_nodes + 1
        self._joined: list[str] = []  # notes of replacement nodes started since replace_lost_nodes last said
        self._joining_lock = threading.Lock()
        self._adding = threading.Lock()
        self.log: list[str] = []  # what the driver did to the world, in order

    # ----------------------------------------------------------------- start and stop
    def start(self) -> SoakServices:
        try:
            self.pg = self._stack.enter_context(private_postgres())
            self.s3 = LocalS3Server(self.root / "s3").start()
            self.s3.create_bucket(BUCKET)
            self.cluster = RayStartCluster(head={"num-cpus": "0"})
            self.cluster.add_node("ctl", num_cpus=0, params={"resources": '{"unbroken_control": 1}'})
            for name in self.worker_nodes:
                self.cluster.add_node(name, num_cpus=self.cpus_per_node)
            self.cluster.wait_nodes(2 + len(self.worker_nodes))
            self.start_api()
        except BaseException:
            self.stop()
            raise
        return self

    def start_api(self, port: int | None = None) -> None:
        assert self.cluster is not None
        self.serve = Serve(self.root / "home", address=self.cluster.address, env=self.cluster.env,
                           extra=("--db", self.pg.url), port=port)
        self.serve.wait_ready()

    def stop(self) -> None:
        # A replacement node still starting would be left running: let its `ray start` end first.
        joining = self._adding.acquire(timeout=600)
        if self.serve is not None:
            self.serve.stop()
        if self.cluster is not None:
            self.cluster.stop()
        if self.s3 is not None:
            self.s3.stop()
        self._stack.close()
        if joining:
            self._adding.release()

    def client(self) -> Any:
        assert self.serve is not None
        return self.serve.client()

    def job_checkpoint(self) -> dict[str, Any]:
        """The job spec's checkpoint storage: our S3 server (each job writes under <uri>/<job-id>)."""
        assert self.s3 is not None
        return {"uri": f"s3://{BUCKET}/runs", "s3": {"endpoint_url": self.s3.endpoint_url, "region": "us-east-1",
                                                    "access_key_id": self.s3.access_key,
                                                    "secret_access_key": self.s3.secret_key}}

    # ----------------------------------------------------------------- the service's parts
    def kill_s3(self, down_s: float) -> str:
        assert self.s3 is not None
        self.s3.kill()
        time.sleep(down_s)
        self.s3.start()
        return f"S3 server SIGKILLed, restarted on its data after {down_s:g}s"

    def restart_store(self, down_s: float) -> str:
        import httpx

        self.pg.stop("fast")
        t0 = time.monotonic()
        answer = "no answer"
        with contextlib.suppress(httpx.HTTPError):
            assert self.serve is not None
            client = self.client()
            r = httpx.get(f"{self.serve.url}/v1/jobs", headers={"Authorization": f"Bearer {client.token}"},
                          timeout=10)
            answer = f"{r.status_code}, Retry-After {r.headers.get('retry-after')}"
        time.sleep(max(0.0, down_s - (time.monotonic() - t0)))
        self.pg.start()
        return f"PostgreSQL stopped, started again after {down_s:g}s; the API answered {answer} meanwhile"

    def kill_api(self, down_s: float) -> str:
        assert self.serve is not None
        port = self.serve.port
        for p in session_pids(self.serve.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.serve.proc.wait(timeout=10)
        time.sleep(down_s)
        t0 = time.monotonic()
        self.start_api(port=port)
        return f"unbroken serve SIGKILLed; restarted on the same port, answering {time.monotonic() - t0:.1f}s later"

    def _actor_pids(self, title: str) -> list[int]:
        """Processes of our cluster whose title is `ray::<title>` (idle) or `ray::<title>.<method>`."""
        assert self.cluster is not None
        out = []
        for sid in self.cluster.sids:
            for p in session_pids(sid):
                head = cmdline(p).split(" ", 1)[0]
                if head == f"ray::{title}" or head.startswith(f"ray::{title}."):
                    out.append(p)
        return sorted(out)

    def sigkill_supervisor(self) -> str:
        pids = self._actor_pids("Supervisor")
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        return f"SIGKILLed the supervisor's process {pids}" if pids else "no supervisor process found"

    def sigkill_worker(self, rng: random.Random) -> str:
        pids = self._actor_pids("Worker")
        if not pids:
            return "no worker process found"
        p = rng.choice(pids)
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
        return f"SIGKILLed worker process {p}"

    def replace_lost_nodes(self) -> list[str]:
        """A node whose raylet died (chaos kill_node) is cleared and a fresh one joins (the replaced pod),
        on a thread of its own: on a loaded machine `ray start` can take minutes, and the driver's other
        faults must not wait for it. Returns what happened since the last call."""
        assert self.cluster is not None
        with self._joining_lock:
            added, self._joined = self._joined, []
        for name in list(self.worker_nodes):
            if self.cluster.node_alive(name):
                continue
            self.cluster.kill_node(name)
            self.worker_nodes.remove(name)
            new = f"w{self._next_node}"
            self._next_node += 1
            threading.Thread(target=self._join, args=(name, new), name=f"join-{new}", daemon=True).start()
        return added

    def _join(self, lost: str, new: str) -> None:
        assert self.cluster is not None
        try:
            with self._adding:  # one `ray start` at a time (see RayStartCluster.add_node)
                self.cluster.add_node(new, num_cpus=self.cpus_per_node)
        except AssertionError as e:  # a loaded machine: the job goes on with the nodes it has
            note = f"node {lost} lost; its replacement {new} did not start ({str(e)[:120]})"
        else:
            note = f"node {lost} lost; node {new} joined"
            self.worker_nodes.append(new)
        with self._joining_lock:
            self._joined.append(note)
