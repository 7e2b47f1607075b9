"""Forming and re-forming one job's process group inside long-lived worker processes.

Every generation gets a fresh TCPStore on a fresh port, hosted by that generation's rank 0
(`open_master_store`), and every rank joins with `join_group`. Leaving (`leave_group`) destroys
the group at once: its sockets close, so peers still blocked in a collective with this rank
see 'Connection reset' instead of waiting for the timeout (NOTES.md: a gloo abort does not
unblock a collective; closing the sockets does).

The collective timeout follows the job: a floor (fault_tolerance.collective_timeout_s), raised
to a multiple of the slowest step seen, so a slow but healthy job is not cut off.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel import dist as pdist

# A step may take this many times the slowest step seen before its collectives time out.
TIMEOUT_STEP_FACTOR = 20.0


def collective_timeout_s(floor_s: float, max_step_time_s: float | None) -> float:
    """The process-group timeout: the floor, or TIMEOUT_STEP_FACTOR x the slowest step if longer."""
    if max_step_time_s is None or max_step_time_s <= 0:
        return floor_s
    return max(floor_s, TIMEOUT_STEP_FACTOR * max_step_time_s)


@dataclass
class GroupInfo:
    generation: int
    rank: int
    world_size: int
    host: str
    port: int
    timeout_s: float
    join_s: float  # time spent in init_process_group


def open_master_store(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's TCPStore on a free port (read it back with `.port`)."""
    return pdist.make_store(host, 0, world_size, is_master=True, timeout_s=timeout_s)


def join_group(
    generation: int,
    rank: int,
    world_size: int,
    host: str,
    port: int,
    *,
    device: torch.device,
    timeout_s: float,
    master_store: dist.TCPStore | None = None,
) -> GroupInfo:
    """Leave any old group, then join generation `generation` (rank 0 passes its own master store)."""
    leave_group()
    t0 = time.perf_counter()
    if world_size > 1:
        store = master_store if master_store is not None else pdist.make_store(
            host, port, world_size, is_master=False, timeout_s=timeout_s
        )
        # A prefix per generation: keys of an old generation can never satisfy a new one.
        prefixed = dist.PrefixStore(f"gen{generation}/", store)
        pdist.init_process_group(rank, world_size, prefixed, device=device, timeout_s=timeout_s)
    return GroupInfo(generation, rank, world_size, host, port, timeout_s, time.perf_counter() - t0)


def leave_group() -> None:
    """Destroy the current group (every sub-group with it); safe to call when there is none."""
    # A broken group still has to go; the next join starts clean.
    with contextlib.suppress(Exception):
        pdist.destroy_process_group()


def socket_fds() -> dict[int, str]:
    """This process's open sockets, fd -> 'socket:[inode]' (Linux /proc; empty elsewhere)."""
    out: dict[int, str] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out[int(fd)] = link
    return out


def sever_new_connections(before: dict[int, str]) -> int:
    """shutdown() every TCP connection opened since `before` (the group's own: gloo pairs, store).

    Destroying a gloo group does not close its sockets while anything still references it (the
    mesh, FSDP state, DTensors...), so ranks blocked on this one would wait for their timeout
    (NOTES.md). A shutdown sends the FIN now: peers fail at once, and the error cascades through
    the ring. Listening sockets are left alone (gloo's listener aborts the process if its accept
    fails); the descriptors stay open (detach) and close when the group's objects are freed.
    """
    n = 0
    for fd, link in socket_fds().items():
        if before.get(fd) == link:
            continue
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            tcp = s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM
            if tcp and not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                s.shutdown(socket.SHUT_RDWR)
                n += 1
        except OSError:
            pass
        finally:
            s.detach()
    return n
