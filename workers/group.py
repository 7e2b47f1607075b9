"""Forming and re-forming one job's process group inside long-lived worker processes.

Every generation gets a fresh TCPStore on a fresh port, hosted by that generation's rank 0
(`open_master_store`), and every rank joins with `join_group`. Leaving (`leave_group`) destroys
the group at once: its sockets close, so peers still blocked in a collective with this rank
see 'Connection reset' instead of waiting for the timeout (NOTES.md: a gloo abort does not
unblock a collective; closing the sockets does).

The collective timeout follows the job: a floor (fault_tolerance.collective_timeout_s), raised
to a multiple of the slowest step seen, so a slow but healthy job is not cut off.

On CUDA (NCCL; written against torch 2.11+) closing sockets is not enough: a rank blocked on a dead
peer waits in a GPU kernel. Each group is formed with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (clean up
only: on an error or timeout the watchdog aborts the communicators and the waiting rank gets an
exception; the process lives, unlike the default 3, which tears it down). Leaving after a failure
aborts every communicator first (`ncclCommAbort`: pending kernels end, nothing waits on a dead
peer) and only then destroys the group; a clean exit just destroys it. `abort_if_stuck` lets the
supervisor's abort reach a rank still blocked in a collective after a short grace.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel import dist as pdist

log = logging.getLogger("unbroken.group")

# A step may take this many times the slowest step seen before its collectives time out.
TIMEOUT_STEP_FACTOR = 20.0

# NCCL error handling: 2 = CleanUpOnly (abort the communicators, raise in the waiting thread, keep the
# process). Read when a ProcessGroupNCCL is built, so it is set before every join; a value the user
# set explicitly is kept.
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


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
    if torch.device(device).type == "cuda":
        for key, value in NCCL_ENV.items():
            os.environ.setdefault(key, value)
    if world_size > 1:
        store = master_store if master_store is not None else pdist.make_store(
            host, port, world_size, is_master=False, timeout_s=timeout_s
        )
        # A prefix per generation: keys of an old generation can never satisfy a new one.
        prefixed = dist.PrefixStore(f"gen{generation}/", store)
        pdist.init_process_group(rank, world_size, prefixed, device=device, timeout_s=timeout_s)
    return GroupInfo(generation, rank, world_size, host, port, timeout_s, time.perf_counter() - t0)


def uses_nccl() -> bool:
    """Whether the current default group has an NCCL backend (CUDA)."""
    if not (dist.is_available() and dist.is_initialized() and torch.cuda.is_available()):
        return False
    try:
        return dist.get_backend() == "nccl" or "nccl" in str(dist.get_backend_config())
    except Exception:  # noqa: BLE001 - a broken group: treat as not NCCL, destroy handles it
        return False


def abort_communicators() -> bool:
    """NCCL: abort every communicator of every group (pending kernels end, blocked waits raise) and
    forget the groups. Returns whether there was anything to abort. No-op on gloo (NOTES.md: a gloo
    abort does not unblock a collective; closing its sockets does, see sever_new_connections)."""
    if not uses_nccl():
        return False
    from torch.distributed.distributed_c10d import _abort_process_group

    with contextlib.suppress(Exception):  # the watchdog may have aborted them already
        _abort_process_group()
    return True


def leave_group(*, abort: bool = False) -> None:
    """Leave the current group (every sub-group with it); safe to call when there is none.

    abort=True (after a failure): NCCL communicators are aborted before the group is destroyed, so
    destroying never waits on work queued with a dead peer. A clean exit (abort=False) destroys only.
    """
    if abort:
        abort_communicators()
    # A broken group still has to go; the next join starts clean.
    with contextlib.suppress(Exception):
        pdist.destroy_process_group()
    if abort:
        pdist.reset_dtensor_caches()  # abort forgot the groups without destroy's cache reset


def abort_if_stuck(left: Callable[[], bool], grace_s: float) -> threading.Thread | None:
    """NCCL: if the training thread has not left its group within `grace_s` (`left()` is still False),
    abort the communicators so a collective blocked on a dead peer returns now, not at its timeout.
    Started by the supervisor's abort; the grace lets a healthy rank stop at its step boundary."""
    if not uses_nccl():
        return None

    def watch() -> None:
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if left():
                return
            time.sleep(0.05)
        if not left() and abort_communicators():
            log.warning("the training thread was still in its group %.1fs after the abort: NCCL "
                        "communicators aborted", grace_s)

    t = threading.Thread(target=watch, name="nccl-abort", daemon=True)
    t.start()
    return t


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
