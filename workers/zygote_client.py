"""What Ray starts in place of Python for a job's worker: it asks its node's zygote (workers.zygote) for a
forked worker process, and stands in for it until it exits.

Ray runs it as the worker actor's `runtime_env.py_executable` (see `command`): `python -S -I
zygote_client.py --key KEY -- default_worker.py ARGS...`. It hands the zygote its standard streams (as
file descriptors), its environment, working folder and arguments; the zygote forks a child that runs
Ray's default_worker with them, and the child registers with the raylet as the worker (Ray tracks a
worker by the pid it registers with, as it does under `uv run`). This process then forwards the signals
it gets to the child and exits with the child's status, so the raylet sees the process it started end
with its worker. Where no zygote answers, the first client of its key on a node starts one and waits for
it; where that fails too, it becomes the worker itself (exec of Python), as without a zygote.

Standard library only, and nothing imported from the package: `-S -I` starts it in ~10 ms.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import NoReturn

CONNECT_WAIT_S = 10.0  # a zygote started now binds its name within this (its imports come after)
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def socket_name(key: str, node_id: str, ray_job: str) -> str:
    """The zygote's address: an abstract Unix socket (no file to clean up) named by its key (env_key), the
    Ray node, the Ray job and the user, so the workers of each key on each node share one zygote per Ray
    job. Per Ray job because Ray's core library, which the zygote loads before it forks, keeps the job id
    it was loaded under (RAY_JOB_ID): a worker forked for another job registered as the zygote's first
    job's, and once that job's driver had exited (an `unbroken serve` restarted) the raylet ended each new
    worker as it registered, so no later job's workers ever started. The jobs one driver launches share
    one Ray job: those of one `unbroken serve` process share the zygotes."""
    digest = hashlib.sha1(f"{key}\0{node_id}\0{ray_job}\0{os.getuid()}".encode()).hexdigest()[:20]
    return f"\0unbroken-zygote/{digest}"


def env_key(env: Mapping[str, str], python: str | None = None) -> str:
    """The zygote key of a job's workers: a digest of the Python that runs them and the environment the job
    sets for them. Jobs whose workers start alike share each node's zygote, so a job after the first one
    starts without importing torch and the engine again (tests.benchmarks.startup_bench --job-starts: a
    4-worker job's first step 5.97 s after its submission instead of 8.77 s on a 2-core VM); a job that
    sets another environment gets its own, so no worker is forked from a process image that holds
    another job's environment. The engine's source files as they are on disk now count too: a zygote
    never serves code older than a later job's."""
    blob = json.dumps([python or sys.executable, sorted(env.items()), _engine_source_stamp()])
    return "env-" + hashlib.sha256(blob.encode()).hexdigest()[:16]


def _engine_source_stamp() -> list[str]:
    """Each source file of the packages a zygote imports (workers.warmup.import_engine), with its size and
    modification time (about 2 ms: some 100 stats)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = []
    for pkg in ("parallel", "workers", "checkpointing"):
        for folder, _dirs, files in os.walk(os.path.join(root, pkg)):
            for f in files:
                if f.endswith(".py"):
                    st = os.stat(os.path.join(folder, f))
                    out.append(f"{os.path.relpath(os.path.join(folder, f), root)}:{st.st_size}:{st.st_mtime_ns}")
    return sorted(out)


def command(key: str, python: str | None = None) -> str:
    """The py_executable that makes Ray start a worker through its node's zygote of `key` (env_key)."""
    exe, path = shlex.quote(python or sys.executable), shlex.quote(os.path.abspath(__file__))
    return f"{exe} -S -I {path} --key {shlex.quote(key)} --"


def _arg(args: list[str], flag: str) -> str:
    return next((a.split("=", 1)[1] for a in args if a.startswith(f"{flag}=")), "")


def _connect(name: str) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(name)
    except OSError:
        s.close()
        return None
    return s


def _log_path(key: str, rest: list[str]) -> str:
    """Where the zygote writes: Ray's log folder of the session (never the first client's streams, which
    end with that worker), else nowhere."""
    logs = os.path.join(_arg(rest, "--temp-dir"), _arg(rest, "--session-name"), "logs")
    if not os.path.isdir(logs):
        return os.devnull
    return os.path.join(logs, f"unbroken-zygote-{key}-{_arg(rest, '--node-id')[:12]}.log")


def _start_zygote(key: str, node_id: str, ray_job: str, log: str) -> subprocess.Popen[bytes]:
    """A zygote for this key on this node, in a process group of its own (Ray ends a worker by killing its
    group: this client's) but in the node's session, where whoever manages the node's processes finds it."""
    with open(os.devnull, "rb") as devnull, open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "workers.zygote", "--key", key, "--node-id", node_id, "--ray-job", ray_job,
             "--raylet-pid", os.environ.get("RAY_RAYLET_PID", "0")],
            stdin=devnull, stdout=out, stderr=out, process_group=0, close_fds=True,
        )


def _zygote(key: str, rest: list[str]) -> socket.socket | None:
    node_id, ray_job = _arg(rest, "--node-id"), os.environ.get("RAY_JOB_ID", "")
    name = socket_name(key, node_id, ray_job)
    s = _connect(name)
    if s is not None:
        return s
    try:
        proc = _start_zygote(key, node_id, ray_job, _log_path(key, rest))
    except OSError:
        return None
    deadline = time.monotonic() + CONNECT_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.02)
        s = _connect(name)
        if s is not None:
            return s
        # 0: another client's zygote took the name first (keep trying it); else it could not start.
        if proc.poll() not in (None, 0):
            return None
    return None


def _lines(s: socket.socket):  # type: ignore[no-untyped-def]
    buf = b""
    while True:
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield json.loads(line)
        chunk = s.recv(4096)
        if not chunk:
            return
        buf += chunk


def _become_python(rest: list[str]) -> NoReturn:
    os.execv(sys.executable, [sys.executable, *rest])


def alive(pid: int) -> bool:
    """Whether process `pid` exists (a pid of 0 or less: unknown, taken as alive)."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _wait_gone(pid: int) -> None:
    while alive(pid):
        time.sleep(0.1)


def main(argv: list[str]) -> None:
    if len(argv) < 4 or argv[0] != "--key" or argv[2] != "--":
        sys.exit("usage: zygote_client.py --key KEY -- default_worker.py ARGS...")
    key, rest = argv[1], argv[3:]
    s = _zygote(key, rest)
    if s is None:
        _become_python(rest)
    request = json.dumps({"argv": rest, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    try:
        socket.send_fds(s, [struct.pack("!Q", len(request))], [0, 1, 2])
        s.sendall(request)
        replies = _lines(s)
        first = next(replies, None)
    except OSError:
        first = None
    if not first or "pid" not in first:  # nothing was forked: be the worker ourselves
        if first and first.get("error"):
            print(f"unbroken zygote: {first['error']}; starting the worker without it", file=sys.stderr)
        _become_python(rest)
    child = int(first["pid"])
    for sig in _FORWARDED:
        signal.signal(sig, lambda n, _f: os.kill(child, n))
    code = 1
    try:
        last = next(replies, None)
        if last is not None and "exit" in last:
            code = int(last["exit"])
        else:  # the zygote went first: the child is init's now
            _wait_gone(child)
    except OSError:
        _wait_gone(child)
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
