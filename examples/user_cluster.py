"""The user's path on one machine: a Ray cluster started with `ray start` (plain, or with the KubeRay
manifests' rayStartParams), and a real `unbroken serve` process in front of it. `make demo` runs on
it, and so do the end-to-end tests.

Every process is started in a session of its own and stopped by PID at the end (found by session id
and by this cluster's private temp dir), never by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from service.local_cluster import FAST_FAILURE_DETECTION, discard_ray_temp
from workers.ports import free_port

REPO = Path(__file__).resolve().parents[1]
UNBROKEN = str(Path(sys.executable).with_name("unbroken"))
# How long a node (and its workers) waits for a restarted GCS before giving up; Ray's default is 60 s.
GCS_RECONNECT_TIMEOUT_S = 300
RAY = str(Path(sys.executable).with_name("ray"))


def session_pids(sid: int) -> set[int]:
    """The live processes of session `sid` (from /proc; a zombie has exited and only awaits its parent)."""
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                out.add(int(d.name))
    return out


def cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def stop_sessions(sids: list[int], marker: str | None, grace_s: float = 2.0) -> None:
    """SIGTERM, then after `grace_s` SIGKILL, every process of these sessions or naming `marker` (our temp
    dir; None: the sessions' only). Ray's raylet drains for up to 30 s on SIGTERM; nothing of a test or
    demo cluster needs that."""

    def ours() -> set[int]:
        found: set[int] = set()
        for sid in sids:
            found |= session_pids(sid)
        if marker is None:
            return found
        return found | {int(p) for p in os.listdir("/proc") if p.isdigit() and marker in cmdline(int(p))}

    mine = {os.getpid(), os.getsid(0)}  # never this test process or its session
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in ours() - mine:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, sig)
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 15)
        while time.monotonic() < deadline and ours() - mine:
            time.sleep(0.3)


def manifest_start_params() -> tuple[dict[str, str], dict[str, str]]:
    """(head, cpu worker group) rayStartParams of deploy/kuberay/raycluster.yaml."""
    rc = next(d for d in yaml.safe_load_all((REPO / "deploy" / "kuberay" / "raycluster.yaml").read_text())
              if d and d["kind"] == "RayCluster")
    head = dict(rc["spec"]["headGroupSpec"]["rayStartParams"])
    cpu = next(g for g in rc["spec"]["workerGroupSpecs"] if g["groupName"] == "cpu")
    return head, dict(cpu["rayStartParams"])


def _flags(params: dict[str, str]) -> list[str]:
    """rayStartParams as `ray start` flags, the way KubeRay writes them (values as given; JSON quoted once)."""
    out = []
    for k, v in params.items():
        if k == "dashboard-host":
            v = "127.0.0.1"  # the manifest's 0.0.0.0 is for a pod; here: loopback only
        if k == "resources":
            v = json.loads(v) if v.startswith('"') else v  # KubeRay strips one level of quoting
        out.append(f"--{k}={v}")
    return out


class RayStartCluster:
    """A head and worker "nodes" started with `ray start --block` on private ports and temp dir.

    A plain multi-node Ray cluster as on any Linux machines: on the machine's own address (not our
    embedded clusters' loopback mode), every node a raylet of its own. Token auth is off for this
    private cluster (tests/deploy/test_head_script.py does the same); node death is seen in seconds.
    """

    def __init__(self, *, head: dict[str, str] | None = None, temp: str | None = None,
                 gcs_redis: str | None = None) -> None:
        self.temp = temp or tempfile.mkdtemp(prefix="ubrs-", dir="/tmp")  # short: Ray's socket paths
        self._own_temp = temp is None  # one made here goes at stop() (discard_ray_temp)
        self.port = free_port()
        self.sids: list[int] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.node_sids: dict[str, int] = {}  # worker nodes by name: the session of their `ray start`
        env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
        self.env = {**env, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    **{f"RAY_{k}": str(v) for k, v in FAST_FAILURE_DETECTION.items()},
                    # `ray start` waits for the node's registration (Ray's hint: raylet_start_wait_time_s);
                    # the raylet's own ~20 s wait for its agent's port file is fixed, hence the retries.
                    "RAY_agent_register_timeout_ms": "120000", "RAY_raylet_start_wait_time_s": "120"}
        self.head_env = dict(self.env)
        if gcs_redis:
            # GCS fault tolerance as KubeRay sets it up (gcsFaultToleranceOptions): the GCS keeps its tables
            # in Redis under a namespace of this cluster's own, and every node waits for a restarted GCS
            # instead of exiting after Ray's default 60 s.
            self.head_env |= {"RAY_REDIS_ADDRESS": gcs_redis,
                              "RAY_external_storage_namespace": Path(self.temp).name}
            self.env["RAY_gcs_rpc_server_reconnect_timeout_s"] = str(GCS_RECONNECT_TIMEOUT_S)
            self.head_env["RAY_gcs_rpc_server_reconnect_timeout_s"] = str(GCS_RECONNECT_TIMEOUT_S)
        head = dict(head if head is not None else {"num-cpus": "0"})
        self._head_args = ["--head", f"--port={self.port}", f"--temp-dir={self.temp}",
                           f"--dashboard-port={free_port()}", "--include-dashboard=false",
                           f"--ray-client-server-port={free_port()}", *_flags(head)]
        self._start_head("head")

    def kill_head(self) -> None:
        """SIGKILL every process of the head node (GCS, raylet, agents): the head pod dies."""
        head_sid = self.sids[0]
        for p in session_pids(head_sid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while session_pids(head_sid) and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.procs[0].wait(timeout=5)

    def restart_head(self) -> None:
        """Start the head again on the same address (the restarted pod): with GCS fault tolerance the new
        GCS loads the cluster's tables from Redis and the other nodes reconnect to it."""
        self._start_head("head-restarted", replaces=True)

    def _start_head(self, name: str, *, replaces: bool = False) -> None:
        """Start the head (`replaces`: in place of a killed one, as procs[0] and sids[0]) and wait for its
        address; a start that fails or times out on a loaded machine is tried twice more on the same ports.
        The error carries every try's log."""
        logs = []
        for attempt in range(3):
            log_name = name if attempt == 0 else f"{name}-retry{attempt}"
            logs.append(log_name)
            if replaces:
                (Path(self.temp) / "ray_current_cluster").unlink(missing_ok=True)
            started = time.time()
            self._start(log_name, self._head_args, env=self.head_env)
            if replaces:  # procs[0] and sids[0] are the live head's
                self.procs.insert(0, self.procs.pop())
                self.sids.insert(0, self.sids.pop())
            if self._head_address_written(started):
                return
            self.kill_head()  # whatever of this try still runs, before the next one binds the same ports
            replaces = True  # the next try takes this one's place
        tails = "\n".join(f"--- {n}.log\n{(Path(self.temp) / f'{n}.log').read_text()[-2000:]}" for n in logs)
        raise AssertionError(f"ray start --head did not come up, {len(logs)} tries:\n{tails}")

    def _head_address_written(self, started: float, timeout: float = 180.0) -> bool:
        """Wait for the head's address as `ray start` writes it (the machine's address and our port) and take
        it; False if its `ray start` exited first, its raylet failed, or the time ran out."""
        f = Path(self.temp) / "ray_current_cluster"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if f.exists() and f.read_text().strip():
                self.address = f.read_text().strip().splitlines()[0]
                return True
            if self.procs[0].poll() is not None or self._raylet_failed_since(started):
                return False
            time.sleep(0.5)
        return False

    def _raylet_failed_since(self, started: float) -> bool:
        """Whether the newest session's raylet, written to since `started`, ended waiting for its agent. On a
        loaded machine the head's raylet exits when its agent writes its port file ~20 s late (a wait Ray
        does not let us set); `ray start` itself then waited out raylet_start_wait_time_s (beside two busy loops
        standing in for CI's load, a head and its one retry were each lost so, ~110 s apiece)."""
        # (raylet.out, or raylet.N.out where a head with GCS fault tolerance took its tries' stored session)
        for log in (Path(self.temp) / "session_latest" / "logs").glob("raylet*.out"):
            with contextlib.suppress(OSError):
                if log.stat().st_mtime >= started and "Timed out waiting for file" in log.read_text(errors="replace"):
                    return True
        return False

    def _start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        log = open(Path(self.temp) / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        p = subprocess.Popen([RAY, "start", "--block", "--disable-usage-stats", *args], stdout=log,
                             stderr=subprocess.STDOUT, env=env or self.env, start_new_session=True)
        self.procs.append(p)
        self.sids.append(p.pid)

    def add_node(self, name: str, num_cpus: int, params: dict[str, str] | None = None, *,
                 timeout: float = 60.0) -> None:
        """Start a node and wait until it has joined (one at a time: two raylets starting at once on one
        loaded machine made one of them time out during its start-up). A start that fails so is retried,
        and so is one still not up after `timeout` (8-11 s is usual on a loaded 2-core machine; CI saw
        `ray start` hang for 180 s and more, twice, its cause unknown: the error carries the logs)."""
        args = [f"--address={self.address}", f"--num-cpus={num_cpus}", f"--object-store-memory={200 * 1024 * 1024}",
                *_flags(params or {})]
        tails = []
        for attempt in range(3):  # a raylet whose agent starts over ~20 s late exits: try again
            log_name = name if attempt == 0 else f"{name}-retry{attempt}"
            self._start(log_name, args)
            log = Path(self.temp) / f"{log_name}.log"
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.procs[-1].poll() is None:
                if "Ray runtime started" in log.read_text(errors="replace"):
                    self.node_sids[name] = self.sids[-1]
                    return
                time.sleep(0.5)
            # What the try had started (raylet? its agents?), then, still hanging, it goes with its raylet and
            # ports before the next try.
            procs = "; ".join(f"{pid} " + " ".join(Path(t).name for t in cmdline(pid).split()[:4])
                              for pid in sorted(session_pids(self.sids[-1])))
            stop_sessions([self.sids[-1]], None, grace_s=2.0)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.procs[-1].wait(timeout=5)
            tails.append(f"--- {log_name}.log (rc {self.procs[-1].poll()}; its processes: {procs or 'none'}):\n"
                         f"{log.read_text(errors='replace')[-1500:]}")
        raise AssertionError(f"ray start of node {name} failed 3 times:\n" + "\n".join(tails))

    def node_session(self, name: str) -> int:
        """The session of node `name`'s `ray start`: "head" (the live head's, after a restart too) or a worker node's."""
        return self.sids[0] if name == "head" else self.node_sids[name]

    def node_alive(self, name: str) -> bool:
        """Whether the node's raylet still runs."""
        return any("raylet" in cmdline(p).split(" ", 1)[0] for p in session_pids(self.node_session(name)))

    def pids_running(self, name: str, title: str) -> list[int]:
        """The processes of node `name` (a worker node's, or "head") titled `ray::<title>` (idle) or
        `ray::<title>.<method>`."""
        return sorted(p for p in session_pids(self.node_session(name))
                      if (h := cmdline(p).split(" ", 1)[0]) == f"ray::{title}" or h.startswith(f"ray::{title}."))

    def nodes_running(self, title: str) -> list[str]:
        """The worker nodes that hold a process titled `ray::<title>` (idle) or `ray::<title>.<method>`."""
        return [name for name in self.node_sids if self.pids_running(name, title)]

    def kill_node(self, name: str) -> None:
        """SIGKILL every process of a worker node that is left (a node lost for good)."""
        for p in session_pids(self.node_sids.pop(name)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)

    def wait_nodes(self, n: int, timeout: float = 180.0) -> None:
        """Until `n` nodes are alive (asked by one throwaway driver process)."""
        code = (f"import ray, time; ray.init(address={self.address!r}, log_to_driver=False)\n"
                f"end = time.monotonic() + {timeout}\n"
                f"while sum(1 for x in ray.nodes() if x['Alive']) < {n} and time.monotonic() < end: time.sleep(1)\n"
                "print(sum(1 for x in ray.nodes() if x['Alive']))")
        r = subprocess.run([sys.executable, "-c", code], env=self.env, capture_output=True, text=True,
                           timeout=timeout + 120)
        last = (r.stdout.strip().splitlines() or [""])[-1]
        if not (last.isdigit() and int(last) >= n):
            raise AssertionError(f"{n} Ray nodes not alive after {timeout:g}s (saw {last!r}): {r.stderr[-1500:]}")

    def stop(self, keep_logs: bool = False) -> None:
        """Stop every node; the temp dir this cluster made goes unless its logs are kept (discard_ray_temp)."""
        stop_sessions(self.sids, self.temp)
        for p in self.procs:  # reap our own children
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        if self._own_temp:
            discard_ray_temp(self.temp, keep_logs=keep_logs)


class PrivateRedis:
    """A `redis-server` of our own (Debian's package) on a free loopback port, for GCS fault tolerance;
    nothing persisted to disk, stopped by PID."""

    def __init__(self, root: Path) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        root.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(root), "--logfile", str(root / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"redis-server exited {self.proc.returncode}: {(root / 'redis.log').read_text()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1) as c:
                c.sendall(b"PING\r\n")
                if c.recv(16).startswith(b"+PONG"):
                    return
            time.sleep(0.1)
        self.stop()
        raise AssertionError("redis-server did not answer PING within 30 s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


class Serve:
    """`unbroken serve --address <cluster>` as a user runs it, with its own UNBROKEN_HOME."""

    def __init__(self, home: Path, *, address: str | None, env: dict[str, str],
                 extra: tuple[str, ...] = (), port: int | None = None) -> None:
        self.home = home
        self.port = port or free_port()  # a restarted API may keep its address
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**env, "UNBROKEN_HOME": str(home)}
        args = [UNBROKEN, "serve", "--port", str(self.port), *extra]
        if address:
            args += ["--address", address]
        self.log = home / "serve.log"
        home.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:  # a restart appends
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"unbroken serve exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/healthz", timeout=5).status_code == 200 and (self.home / "token").exists():
                    return
            time.sleep(1)
        raise AssertionError(f"unbroken serve not ready after {timeout:g}s:\n{self.log.read_text()[-3000:]}")

    def client(self) -> Any:
        from api.client import Client

        token = json.loads((self.home / "token").read_text())["token"]
        return Client(self.url, token)

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([UNBROKEN, *args], env=self.env, capture_output=True, text=True, timeout=timeout)

    def stop(self) -> None:
        stop_sessions([self.proc.pid], f"--port {self.port}")
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
