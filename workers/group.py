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

The rendezvous is two-level when a rank knows its node's ranks (`local_ranks`; the node agent says
them, workers.node_agent): the node's lowest rank is its leader. It hosts a small store for its node and
a relay (`NodeRelay`, workers.node_relay) that is the node's one client of the master store: the other ranks of the node
talk to the relay only (`RelayStore`), and the relay keeps what it read from the master, so a key
that every rank reads (NCCL's unique id, a gloo rank's address) crosses the master once per node. The
arrival barrier is a tree: ranks check in with their leader, leaders with the master. The master
then has two connections per node instead of one per rank, and 8x fewer arrivals and reads of a
shared key (docs/scale.md; in one process on 2 cores, where the relays' Python shares the GIL, the
tree measured slower end to end than flat). What torch does through the store is unchanged and is
still O(ranks) per rank for gloo: its full mesh has every rank read every rank's address, which the
relay serves from its node's cache (docs/scale.md measures it).

A rendezvous can be aborted (`abort_rendezvous`, from the worker's abort): a rank lost while its
generation forms would otherwise hold every other rank in the arrival barrier until the timeout.
Each process writes ABORTED into the release keys of the stores it hosts (rank 0's master, a
leader's relay), through a connection of its own (a TCPStore client serialises its calls, and the
rank's own is blocked in the wait); a waiter that wakes to that value leaves with RendezvousAborted.
Past the barrier, gloo's mesh waits in the store for each peer's address, and nothing releases that
wait: the abort cuts the join's own connections instead (`sever_new_connections`), so a rank lost
between the release and its address no longer holds the others for the collective timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from parallel import dist as pdist
from workers.node_relay import KEPT_CLONES, NodeRelay, RelayStore, connect_to_leader, relay_id

log = logging.getLogger("unbroken.group")

# NCCL error handling: 2 = CleanUpOnly (abort the communicators, raise in the waiting thread, keep the
# process). Read when a ProcessGroupNCCL is built, so it is set before every join; a value the user
# set explicitly is kept.
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


@dataclass
class GroupInfo:
    generation: int
    rank: int
    world_size: int
    host: str
    port: int
    timeout_s: float
    join_s: float  # time spent joining: the rendezvous and init_process_group
    rendezvous: str = "flat"  # "tree" when the node's ranks went through their leader's relay
    rendezvous_s: float = 0.0  # of join_s: connecting and the arrival barrier


def open_master_store(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's TCPStore on a free port (read it back with `.port`)."""
    return pdist.make_store(host, 0, world_size, is_master=True, timeout_s=timeout_s)


# ===================================================================== aborting a forming generation
ABORTED = b"aborted"  # a release key's value when the generation was aborted before it formed


class RendezvousAborted(RuntimeError):
    """The generation was aborted while its ranks were still arriving or connecting (one of them was lost)."""


_abort_lock = threading.Lock()
_aborted_upto = -1  # this process was told to abort every generation up to this one
_hosted: dict[int, list[tuple[str, int, list[str]]]] = {}  # generation -> (host, port, release keys) hosted here
# (generation, this process's sockets before it began joining) while a join is under way: what an abort cuts.
_joining: tuple[int, dict[int, str]] | None = None


def _host(generation: int, host: str, port: int, keys: list[str]) -> None:
    with _abort_lock:
        _hosted.setdefault(generation, []).append((host, port, keys))
    if aborted(generation):  # the abort came while this store was being opened
        abort_rendezvous(generation)


def _unhost(generation: int) -> None:
    with _abort_lock:
        _hosted.pop(generation, None)


def aborted(generation: int) -> bool:
    """Whether this process was told to abort `generation` (see `abort_rendezvous`)."""
    return _aborted_upto >= generation


def abort_rendezvous(generation: int) -> None:
    """Release every rank waiting in a rendezvous of a generation up to `generation` on a store this
    process hosts: they see ABORTED and leave now rather than at the timeout.

    A rank past the arrival barrier may still be connecting gloo's mesh, waiting in the store for the
    address of a peer lost meanwhile; nothing is released there, and the wait would last the whole
    collective timeout (10.5 s of a recovery in goodput_bench, a node lost just after a grow began).
    Its join's connections (store, relay, gloo pairs) are cut instead, after the releases above: the
    wait fails at once, and `join_group` raises RendezvousAborted."""
    global _aborted_upto
    with _abort_lock:
        _aborted_upto = max(_aborted_upto, generation)
        stores = [x for g, xs in _hosted.items() if g <= generation for x in xs]
        joining = _joining
    for host, port, keys in stores:
        try:
            client = pdist.make_store(host, port, 1, is_master=False, timeout_s=2.0)
            for key in keys:
                client.set(key, ABORTED)
        except Exception as e:  # noqa: BLE001 - the store is gone already: its waiters failed with it
            log.info("could not release the rendezvous on %s:%d: %s", host, port, e)
    if joining is not None and joining[0] <= generation:
        sever_new_connections(joining[1])


def _released(store: dist.Store, key: str, generation: int, rank: int) -> None:
    """After a wait on `key` returned: leave if it was an abort's release, not the barrier's. A store that
    cannot be read once the key is set was closed by its host right after releasing it, which only an
    abort does (a released group keeps its stores for its lifetime)."""
    try:
        value = None if aborted(generation) else store.get(key)
    except Exception as e:  # noqa: BLE001 - the host released and closed: an abort
        raise RendezvousAborted(f"generation {generation} was aborted while rank {rank} was joining it "
                                "(its store closed after the release)") from e
    if value is None or value == ABORTED:
        raise RendezvousAborted(f"generation {generation} was aborted while rank {rank} was joining it")


# ===================================================================== the two-level rendezvous
# A node's leader says where its relay listens in a file on the node's own disk, named after the
# generation's master (a fresh port every generation) and the leader's rank: no store operation is
# spent on finding it. A stale file (a leader that crashed) names a dead port or another relay; the
# rank checks the relay's identity and waits for the right one.
@dataclass
class _Rendezvous:
    """What a joined rank holds for its group's lifetime: torch keeps only the C++ side of a Python
    store, so the Python object (and the relay) must be kept alive here until the group is left."""

    store: dist.Store
    relay: NodeRelay | None = None
    local: dist.Store | None = None
    keep: list[Any] = field(default_factory=list)

    def close(self) -> None:
        if self.relay is not None:
            self.relay.close()


_current: _Rendezvous | None = None


def rendezvous(
    generation: int,
    rank: int,
    world_size: int,
    host: str,
    port: int,
    *,
    timeout_s: float,
    master_store: dist.Store | None = None,
    local_ranks: Sequence[int] | None = None,
) -> _Rendezvous:
    """Connect for generation `generation` and wait until all `world_size` ranks have arrived.

    With `local_ranks` (the global ranks on this rank's node, this one among them), the node's lowest
    rank leads: it opens the node's relay, waits for its node's ranks, checks them in with the master
    as one, and releases them when every node has. The other ranks connect only to their leader.
    Without it (or alone on the node), every rank checks in with the master itself (flat)."""
    _released_or_raise(generation, rank)  # aborted before it began
    deadline = time.monotonic() + timeout_s
    arrived, go = f"rdv/gen{generation}/arrived", f"rdv/gen{generation}/go"
    local = sorted(set(local_ranks)) if local_ranks else [rank]
    if rank not in local:
        raise ValueError(f"rank {rank} is not among its node's ranks {local}")
    leader = local[0]
    ident = relay_id(host, port, generation, leader)
    if rank != leader:  # check in with the leader, wait for its release
        try:
            local_store = connect_to_leader(ident, deadline, timeout_s, stop=lambda: aborted(generation))
        except TimeoutError:
            _released_or_raise(generation, rank)
            raise
        if local_store.add("rdv/in", 1) == len(local) - 1:
            local_store.set("rdv/all-in", b"1")
        try:
            local_store.wait(["rdv/go"], timedelta(seconds=max(0.0, deadline - time.monotonic())))
        except Exception as e:
            _released_or_raise(generation, rank)
            raise TimeoutError(f"generation {generation}: rank {rank} was not released by its node's leader "
                               f"(rank {leader}) within {timeout_s:g}s: not every rank arrived") from e
        _released(local_store, "rdv/go", generation, rank)
        relay_store = RelayStore(local_store, timeout_s)
        return _Rendezvous(relay_store, local=local_store)
    master = master_store if master_store is not None else _connect_master(generation, rank, world_size, host, port,
                                                                           timeout_s)
    if master_store is not None:
        _host(generation, host, port, [go])
    relay = NodeRelay(host, port, ident, timeout_s) if len(local) > 1 else None
    if relay is not None:
        _host(generation, "127.0.0.1", relay.port, ["rdv/all-in", "rdv/go"])
    try:
        if relay is not None:
            try:
                relay.server.wait(["rdv/all-in"], timedelta(seconds=max(0.0, deadline - time.monotonic())))
            except Exception as e:
                _released_or_raise(generation, rank)
                came = relay.server.add("rdv/in", 0) + 1
                raise TimeoutError(f"generation {generation}: {came} of this node's {len(local)} ranks {local} "
                                   f"arrived within {timeout_s:g}s") from e
            _released(relay.server, "rdv/all-in", generation, rank)
        if master.add(arrived, len(local)) == world_size:
            master.set(go, b"1")
        try:
            master.wait([go], timedelta(seconds=max(0.0, deadline - time.monotonic())))
        except Exception as e:
            _released_or_raise(generation, rank)
            raise TimeoutError(f"generation {generation}: {master.add(arrived, 0)} of {world_size} ranks "
                               f"arrived within {timeout_s:g}s") from e
        _released(master, go, generation, rank)
        if relay is not None:
            relay.server.set("rdv/go", b"1")
            relay.unpublish()  # every rank of the node is connected: nobody else needs its port
    except BaseException:
        if relay is not None:
            if aborted(generation):
                with contextlib.suppress(Exception):  # the node's ranks leave now, not at their timeout
                    relay.server.set("rdv/go", ABORTED)
            relay.close()
        raise
    finally:
        _unhost(generation)
    return _Rendezvous(master, relay=relay)


def _connect_master(generation: int, rank: int, world_size: int, host: str, port: int,
                    timeout_s: float) -> dist.TCPStore:
    """A leader's connection to the generation's master store. torch says only that a socket timed out;
    the rank's error names the generation and the address it could not reach."""
    try:
        return pdist.make_store(host, port, world_size, is_master=False, timeout_s=timeout_s)
    except Exception as e:
        _released_or_raise(generation, rank)
        raise TimeoutError(f"generation {generation}: rank {rank} could not reach the rendezvous master at "
                           f"{host}:{port} within {timeout_s:g}s ({type(e).__name__})") from e


def _released_or_raise(generation: int, rank: int) -> None:
    """A wait failed: an abort told to this process explains it (its store may be gone)."""
    if aborted(generation):
        raise RendezvousAborted(f"generation {generation} was aborted while rank {rank} was joining it")


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
    local_ranks: Sequence[int] | None = None,
    on_connect: Callable[[], None] | None = None,
) -> GroupInfo:
    """Leave any old group, then join generation `generation` (rank 0 passes its own master store;
    `local_ranks`, the ranks on this node, makes the rendezvous two-level, see `rendezvous`).
    `on_connect` runs once every rank has arrived, as the group's connections are about to form (chaos
    `at: join`)."""
    global _joining
    leave_group()
    before = socket_fds()
    try:
        return _join(generation, rank, world_size, host, port, device, timeout_s, master_store, local_ranks, before,
                     on_connect)
    except RendezvousAborted:
        raise
    except Exception as e:
        if aborted(generation):  # an abort cut this join's connections (abort_rendezvous)
            raise RendezvousAborted(f"generation {generation} was aborted while rank {rank} was connecting to "
                                    f"its peers ({type(e).__name__})") from e
        raise
    finally:
        with _abort_lock:
            _joining = None


def _join(generation: int, rank: int, world_size: int, host: str, port: int, device: torch.device,
          timeout_s: float, master_store: dist.TCPStore | None, local_ranks: Sequence[int] | None,
          before: dict[int, str], on_connect: Callable[[], None] | None) -> GroupInfo:
    global _current, _joining
    t0 = time.perf_counter()
    if torch.device(device).type == "cuda":
        for key, value in NCCL_ENV.items():
            os.environ.setdefault(key, value)
    rdv_s, kind = 0.0, "flat"
    if world_size > 1:
        rdv = rendezvous(generation, rank, world_size, host, port, timeout_s=timeout_s,
                         master_store=master_store, local_ranks=local_ranks)
        _current = rdv
        rdv_s = time.perf_counter() - t0
        kind = "tree" if rdv.relay is not None or rdv.local is not None else "flat"
        store = rdv.store
        if store is master_store:  # rank 0's own connection predates this join: one an abort can cut
            store = master_store.clone()  # type: ignore[attr-defined]
            rdv.keep.append(store)
        # A prefix per generation: keys of an old generation can never satisfy a new one.
        prefixed = dist.PrefixStore(f"gen{generation}/", store)
        rdv.keep.append(prefixed)
        with _abort_lock:  # every rank arrived; from here an abort cuts this join's connections
            _joining = (generation, before)
        try:
            if aborted(generation):  # it came between the release and the line above
                raise RendezvousAborted(f"generation {generation} was aborted as rank {rank} was released")
            if on_connect is not None:
                on_connect()
            pdist.init_process_group(rank, world_size, prefixed, device=device, timeout_s=timeout_s)
        except BaseException:
            leave_group()
            raise
    elif on_connect is not None:  # a group of one connects to no one; it still forms here
        on_connect()
    join_s = time.perf_counter() - t0
    log.info("generation %d: rank %d of %d joined through a %s rendezvous (%.3fs; group formed in %.3fs)",
             generation, rank, world_size, kind, rdv_s, join_s)
    return GroupInfo(generation, rank, world_size, host, port, timeout_s, join_s, kind, rdv_s)


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
    global _current
    # A broken group still has to go; the next join starts clean.
    with contextlib.suppress(Exception):
        pdist.destroy_process_group()
    if _current is not None:  # after the group: it may use the store until destroyed
        _current.close()
        _current = None
        KEPT_CLONES.clear()
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
