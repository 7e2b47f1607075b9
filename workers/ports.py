"""Free loopback ports for servers we start (Ray heads, stores, API servers, process groups' masters)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RAY_WORKER_PORTS_END = 19999  # Ray's default max_worker_port: its worker processes take ports up to it
_handed_out: set[int] = set()  # ports free_port returned in this process


def _ephemeral_ports_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A free loopback port for a server started later, outside the kernel's ephemeral range: a port
    found by binding port 0 is one the kernel hands out again to any socket meanwhile (a `ray start`
    head's client server, bound 4 s after, found its port taken and the head stopped), and above
    Ray's worker ports."""
    lo, hi = _RAY_WORKER_PORTS_END + 1, _ephemeral_ports_start() - 1
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randint(lo, hi) if hi > lo else 0
        if port in _handed_out:
            continue  # free now, but a server of ours may be about to bind it
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # taken
            port = int(s.getsockname()[1])
        _handed_out.add(port)
        return port
    raise OSError(f"no free loopback port in {lo}..{hi}")
