"""An embedded Ray cluster of one or more nodes on this machine.

Used by `unbroken serve`/`run` when no `--address` is given, by `make demo`, and by tests that
need several "nodes" (each a raylet with its own custom resources) so that node loss can be
simulated by killing one node's processes. Built on Ray's own `ray.cluster_utils.Cluster`,
which tracks every process it starts and stops them by PID: nothing else on the machine is
touched, and nothing is left behind when the cluster shuts down.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any

# Keep every Ray address on the loopback interface (Ray's single-machine mode, as on macOS):
# by default Ray rewrites 127.0.0.1 to the machine's external address, and our servers bind
# to 127.0.0.1 only. Set before Ray is imported here, and inherited by every process we start.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402
from ray._private import ray_constants  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

# If ray was imported before this module, its constant was read already: align it.
ray_constants.ENABLE_RAY_CLUSTER = os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] not in ("0", "false", "False")

# Node death is seen in ~3 s with these, against ~14 s with Ray's defaults. NOTES.md's tighter
# 500 ms x 3 (~1.4 s) marked live raylets dead on a loaded 2-core machine, so leave some slack.
FAST_FAILURE_DETECTION: dict[str, Any] = {
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 5,
    "health_check_initial_delay_ms": 1000,
}

from checkpointing.keeper import CONTROL_RESOURCE, NODE_RESOURCE_PREFIX  # noqa: E402
from workers.ports import free_port  # noqa: E402

KEEP_RAY_LOGS_ENV = "UNBROKEN_KEEP_RAY_LOGS"  # set: a stopped cluster's temp dir (Ray's logs) stays


def discard_ray_temp(path: str, *, keep_logs: bool = False) -> None:
    """Remove a stopped cluster's private temp dir (Ray's logs and sockets, a few MB a run) unless its logs
    are kept: `keep_logs` (a failed run's), or UNBROKEN_KEEP_RAY_LOGS in the environment (to read the
    workers' logs after a test or a benchmark). Every cluster our tests, benchmarks and examples start
    ends here."""
    if not keep_logs and not os.environ.get(KEEP_RAY_LOGS_ENV):
        shutil.rmtree(path, ignore_errors=True)


class LocalCluster:
    """A private multi-node Ray cluster; each node carries the resource `unbroken_node_<name>`.

    >>> with LocalCluster(head_cpus=2) as c:
    ...     c.add_node("b", num_cpus=2)
    ...     c.connect()
    """

    def __init__(
        self,
        head_cpus: float = 2,
        *,
        head_resources: dict[str, float] | None = None,
        fast_failure_detection: bool = True,
        dashboard: bool = False,
        metrics_export_port: int | None = None,
        object_store_mb: int = 200,
        temp_dir: str | None = None,
    ) -> None:
        self.head_cpus = head_cpus
        self.head_resources = dict(head_resources or {})
        self.fast_failure_detection = fast_failure_detection
        self.dashboard = dashboard
        # Ray starts its dashboard process even when the UI is off; a private port keeps two
        # clusters on one machine from fighting over 8265.
        self.dashboard_port = free_port()
        self.metrics_export_port = metrics_export_port
        self.object_store_mb = object_store_mb
        # A short private temp dir: Ray's socket paths must stay under 108 characters. One made here goes
        # at shutdown (discard_ray_temp).
        self._own_temp = temp_dir is None
        self.temp_dir = temp_dir or tempfile.mkdtemp(prefix="ubray-", dir="/tmp")
        self._cluster: Cluster | None = None
        self.nodes: dict[str, Any] = {}

    @property
    def address(self) -> str:
        if self._cluster is None:
            raise RuntimeError("the cluster is not started; call start() first")
        return str(self._cluster.address)

    @property
    def dashboard_url(self) -> str | None:
        return f"http://127.0.0.1:{self.dashboard_port}" if self.dashboard else None

    @staticmethod
    def dashboard_headers() -> dict[str, str]:
        """HTTP headers the dashboard's REST API needs from this driver: Ray's token when the cluster
        runs with token auth. Ray turns that on by itself for a new local cluster, and for any cluster
        started once ~/.ray/auth_token exists (unless RAY_AUTH_MODE says otherwise), so whether it is
        on depends on the machine's history: ask Ray rather than guess. Call after connect()."""
        from ray._private.authentication.http_token_authentication import get_auth_headers_if_auth_enabled

        return dict(get_auth_headers_if_auth_enabled({}))

    def start(self) -> str:
        head_args: dict[str, Any] = {
            "num_cpus": self.head_cpus,
            "resources": {f"{NODE_RESOURCE_PREFIX}head": 1.0, CONTROL_RESOURCE: 1.0, **self.head_resources},
            "object_store_memory": self.object_store_mb * 1024 * 1024,
            "temp_dir": self.temp_dir,
            "include_dashboard": self.dashboard,
            "node_ip_address": "127.0.0.1",
        }
        head_args["dashboard_host"] = "127.0.0.1"
        head_args["dashboard_port"] = self.dashboard_port
        # The head's dashboard agent otherwise takes Ray's fixed 52365 (Ray gives added nodes free ports);
        # where another cluster holds it, this agent serves nothing and never registers, and Ray's log
        # API then answers "Agent for node id ... doesn't exist" for every actor on the head.
        head_args["dashboard_agent_listen_port"] = free_port()
        if self.metrics_export_port is not None:
            head_args["metrics_export_port"] = self.metrics_export_port
        if self.fast_failure_detection:
            head_args["_system_config"] = dict(FAST_FAILURE_DETECTION)
        # Ray's helper records the address in its default temp folder; make sure that folder exists.
        os.makedirs(os.path.join(tempfile.gettempdir(), "ray"), exist_ok=True)
        self._cluster = Cluster(initialize_head=True, head_node_args=head_args, shutdown_at_exit=True)
        self.nodes["head"] = self._cluster.head_node
        return self.address

    def add_node(self, name: str, num_cpus: float = 2, resources: dict[str, float] | None = None) -> Any:
        """Start another raylet (a simulated node) with the resource `unbroken_node_<name>`."""
        if self._cluster is None:
            raise RuntimeError("start() the cluster before adding nodes")
        if name in self.nodes:
            raise ValueError(f"a node named {name!r} already exists")
        node = self._cluster.add_node(
            num_cpus=num_cpus,
            resources={f"{NODE_RESOURCE_PREFIX}{name}": 1.0, **(resources or {})},
            object_store_memory=self.object_store_mb * 1024 * 1024,
            node_ip_address="127.0.0.1",
        )
        self.nodes[name] = node
        return node

    def kill_node(self, name: str) -> None:
        """SIGKILL every process of one node (its raylet, object store and workers): a node loss."""
        if name == "head":
            raise ValueError("killing the head node ends the cluster; kill a worker node instead")
        node = self.nodes.pop(name)
        assert self._cluster is not None
        # All at once, as a machine's loss: a worker forked by a job's zygote is no child of the raylet and
        # would train on (its peers' collectives with it working) until it noticed its raylet gone, and a
        # stopped (freeze_node's) process does not exit when its raylet goes.
        for pid in _node_pids(node):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._cluster.remove_node(node, allow_graceful=False)  # (and Ray's own bookkeeping of the node)

    def freeze_node(self, name: str) -> list[int]:
        """SIGSTOP every process of one node (its raylet, object store, and the workers and agents it
        started): a node that hangs or is cut off. Its raylet's port still takes connections, but nothing
        answers, so only silence tells. kill_node ends it. Returns the PIDs stopped."""
        if name == "head":
            raise ValueError("freezing the head node stops the cluster; freeze a worker node instead")
        pids = _node_pids(self.nodes[name])
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        return pids

    def node_id(self, name: str) -> str:
        return str(self.nodes[name].node_id)

    def connect(self, namespace: str = "unbroken") -> None:
        """Connect this process as a driver (ray.init with the cluster's explicit address)."""
        ray.init(address=self.address, namespace=namespace, log_to_driver=False, _node_ip_address="127.0.0.1")

    def shutdown(self, keep_logs: bool = False) -> None:
        """Stop every node; the temp dir this cluster made goes unless its logs are kept (discard_ray_temp)."""
        if ray.is_initialized():
            ray.shutdown()
        if self._cluster is not None:
            self._cluster.shutdown()
            self._cluster = None
        self.nodes.clear()
        if self._own_temp:
            discard_ray_temp(self.temp_dir, keep_logs=keep_logs)

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _node_pids(node: Any) -> list[int]:
    """Every process of a node of this cluster: its raylet, object store and agents, what they started,
    and the workers forked by a job's zygote (workers.zygote), no descendants of the raylet: their
    environment names their raylet as every worker's does."""
    roots = [info.process.pid for infos in node.all_processes.values() for info in infos
             if getattr(info, "process", None) is not None]
    raylets = [info.process.pid for info in node.all_processes.get("raylet", [])
               if getattr(info, "process", None) is not None]
    return list(dict.fromkeys(_descendants(roots + [p for r in raylets for p in _workers_of_raylet(r)])))


def _workers_of_raylet(raylet_pid: int) -> list[int]:
    """Processes whose environment says RAY_RAYLET_PID=raylet_pid (Linux /proc; ours only)."""
    want = f"RAY_RAYLET_PID={raylet_pid}".encode()
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if want in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                    out.append(int(entry))
            except OSError:
                continue
    return out


def stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (which may hold spaces): state, ppid, pgrp, session,
    tty, tpgid, flags, ... (Linux; raises OSError when the process is gone)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2:].split()


def parent_pid(pid: int) -> int:
    """Process `pid`'s parent (Linux /proc; raises OSError when it is gone)."""
    return int(stat_fields(pid)[1])


def _descendants(roots: list[int]) -> list[int]:
    """`roots` and every process below them (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            children.setdefault(parent_pid(int(entry)), []).append(int(entry))
        except OSError:
            continue
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def node_name_of_current_process() -> str | None:
    """The `unbroken_node_<name>` this process runs on, from inside a Ray task or actor."""
    from checkpointing.nodes import current_node_name  # one implementation, importable by workers too

    return current_node_name()


def env_for_fast_detection() -> dict[str, str]:
    """The same settings as environment variables, for `ray start --head` launched by hand."""
    return {f"RAY_{k}": str(v) for k, v in FAST_FAILURE_DETECTION.items()} | dict(os.environ)
