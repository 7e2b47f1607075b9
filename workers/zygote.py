"""A zygote on a node: one process that imports torch and the engine once, and forks each worker process
that the jobs of its key start there (workers.zygote_client.env_key: the same Python and environment), so
a replacement, a spare, a grow-back or the next job set up alike does not import them again.

A fresh worker costs ~3.5 CPU-s before it is ready (Ray, torch, the engine, the first step's lazy
imports); on a node whose cores train, that time comes out of the training ranks' steps (measured by
tests.benchmarks.startup_bench: a child forked after the engine's imports needs ~0.3 CPU-s of it). Its
clients are workers.zygote_client, which Ray starts as the worker actor's py_executable.

    python -m workers.zygote --key KEY --node-id NODE --raylet-pid PID

It binds its name at once (workers.zygote_client.socket_name), imports the engine on a low-priority
thread (workers.warmup.import_engine, and Ray's module; clients wait meanwhile), then serves: each client sends its
standard streams' descriptors, environment, working folder and argv (Ray's default_worker and its
arguments); the zygote forks, and the child takes them over and runs default_worker as a fresh
interpreter would (`__main__`, argv, sys.path[0], random seeds drawn again). The child's pid and, once
it is reaped, its exit status go back to the client. Ray is imported here but never initialized, so each
child connects to Ray as a new process does. The zygote exits when its raylet is gone, or when it has had no child and
no request for IDLE_S; its children do not depend on it.

Forking is safe here because the zygote has one thread when it forks (the import thread has ended), has
never started torch's thread pools or CUDA, and holds no sockets but its own.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import runpy
import select
import signal
import socket
import struct
import sys
import time
import traceback
from typing import Any

from workers.zygote_client import alive, socket_name

FORKED_ENV = "UNBROKEN_FORKED_FROM"  # set in each child: the zygote's pid (Worker.info says it was forked)
CLIENT_ENV = "UNBROKEN_FORK_CLIENT"  # and the pid of the client that stands in for it (the process Ray started)
# No child alive and no request for this long: no job of its key has a worker on the node. A job set up
# alike that starts within it forks from this one (the suite's jobs follow each other within seconds).
IDLE_S = 120.0
_REQUEST_MAX = 16 << 20


def _peer(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the client at the other end."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return int(pid), int(uid)


def _read_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """(the request, the three descriptors) from a client; raises ValueError on a malformed one."""
    conn.settimeout(10.0)
    data, fds, _flags, _addr = socket.recv_fds(conn, 65536, 3)
    try:
        if len(fds) != 3 or len(data) < 8:
            raise ValueError(f"expected 3 descriptors and a length, got {len(fds)} and {len(data)} bytes")
        (n,) = struct.unpack("!Q", data[:8])
        if n > _REQUEST_MAX:
            raise ValueError(f"a request of {n} bytes")
        body = bytearray(data[8:])
        while len(body) < n:
            chunk = conn.recv(min(1 << 20, n - len(body)))
            if not chunk:
                raise ValueError("the client closed its request half-way")
            body += chunk
        req = json.loads(bytes(body))
        if not (isinstance(req.get("argv"), list) and req["argv"] and isinstance(req.get("env"), dict)
                and isinstance(req.get("cwd"), str)):
            raise ValueError("a request needs argv (a non-empty list), env (an object) and cwd")
    except Exception:
        for fd in fds:
            os.close(fd)
        raise
    conn.settimeout(None)
    return req, fds


def _send(conn: socket.socket, **msg: Any) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps(msg).encode() + b"\n")


def _become_worker(req: dict[str, Any], fds: list[int], zygote_pid: int, client_pid: int) -> None:
    """In the child: take over the client's streams, environment, folder and argv, in a process group of
    its own: Ray kills a worker's whole group when it ends one, and the zygote's is its siblings'."""
    os.setpgid(0, 0)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    # As a fresh interpreter has them: SIGINT raises KeyboardInterrupt, SIGPIPE stays ignored (a write to a
    # closed socket raises BrokenPipeError rather than killing the worker), the zygote's SIGCHLD wake-up goes.
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in req["env"].items()})
    os.environ[FORKED_ENV] = str(zygote_pid)
    os.environ[CLIENT_ENV] = str(client_pid)
    sys.argv = [str(a) for a in req["argv"]]
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
    random.seed()  # (Python's own at-fork hook does this too; torch's and numpy's have none)
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _preload() -> None:
    from workers.low_priority import at_low_priority
    from workers.warmup import import_engine

    import_engine()  # on a low-priority thread: the zygote may start beside training ranks
    # Ray's module too (~0.3 CPU-s a worker), imported and never initialized: it starts no thread, and
    # what it reads from the environment at import is the same for every worker this zygote serves (the
    # zygote's environment is its first client's; the key covers what a job sets, the socket's name the
    # node and the Ray job, whose id Ray's core library keeps from its load). Not our worker module:
    # importing it starts a thread.
    at_low_priority(_import_ray, "import")
    gc.collect()
    gc.freeze()  # the children's collections leave these pages unwritten (copy-on-write kept)


def _import_ray() -> None:
    import ray  # noqa: F401


def serve(name: str, raylet_pid: int, idle_s: float = IDLE_S) -> int:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(name)
    except OSError:  # another client started this key's zygote on this node first
        return 0
    listener.listen(64)
    _preload()
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:  # a fork copies only the forking thread: one holding a lock would leave it held
        print(f"unbroken zygote: {threads} threads after the imports; not forking (workers start fresh)",
              file=sys.stderr, flush=True)
        return 1
    me = os.getpid()
    # A child's exit wakes the loop at once (its client exits with it), through a pipe Python's signal
    # machinery writes to.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda _n, _f: None)
    clients: dict[int, socket.socket] = {}  # child pid -> its client's connection
    last = time.monotonic()
    while alive(raylet_pid) and (clients or time.monotonic() - last < idle_s):
        ready, _, _ = select.select([listener, wake_r], [], [], 0.5)
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
        if listener in ready:
            conn, _ = listener.accept()
            last = time.monotonic()
            try:
                client_pid, uid = _peer(conn)
                if uid != os.getuid():
                    raise ValueError("a client of another user")
                req, fds = _read_request(conn)
            except (OSError, ValueError) as e:
                _send(conn, error=f"{type(e).__name__}: {e}")
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                for fd in (wake_r, wake_w):
                    os.close(fd)
                listener.close()
                conn.close()
                for c in clients.values():
                    c.close()
                try:
                    _become_worker(req, fds, me, client_pid)
                except BaseException:  # noqa: BLE001 - never fall back into the zygote's loop
                    traceback.print_exc()
                    os._exit(70)
                runpy.run_path(sys.argv[0], run_name="__main__")
                sys.exit(0)  # Ray's worker ends by sys.exit: the interpreter finalizes as a fresh one would
            for fd in fds:
                os.close(fd)
            clients[pid] = conn
            _send(conn, pid=pid)
        while clients:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = clients.pop(pid, None)
            if conn is not None:
                _send(conn, exit=_exit_code(status))
                conn.close()
            last = time.monotonic()
    listener.close()
    return 0


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code  # a signal's death as a shell reports it


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--key", required=True)
    ap.add_argument("--node-id", default="")
    ap.add_argument("--ray-job", default="")
    ap.add_argument("--raylet-pid", type=int, default=0)
    ap.add_argument("--idle-s", type=float, default=IDLE_S)
    args = ap.parse_args(argv)
    sys.exit(serve(socket_name(args.key, args.node_id, args.ray_job), args.raylet_pid, args.idle_s))


if __name__ == "__main__":
    main()
