"""The in-memory snapshot tier, send side: copy a rank's shard off the training path, send it to two keepers.

    client = SnapshotClient(job_id, rank, world_size, node_name, keepers, optimizer=trainer.optimizer)
    handle = client.snapshot(trainer.state_dict(), trainer.step, generation)  # after the step
    handle.add_done_callback(lambda r: ...)   # r: SnapshotResult(ok, acked=[nodes], errors), on a thread
    client.copy_wait_s                        # training-thread time optimizer steps waited for copies
    client.close()    # before the group re-forms or the state is replaced; build a new client after

The training thread only hands the state over (and, on CUDA, records an event after the optimizer
step). With `optimizer`, a copier thread does the rest while the next forward/backward runs (they
read parameters and optimizer state, never write them): flatten the state, plan the layout (once),
pickle the few non-tensor values, and copy the tensors into one of two reused host buffers (pinned on
CUDA, where the copies run on a side stream that first waits for the recorded event, and the copier
records a second event after them). The optimizer's step pre-hook is the only place training waits:
on CPU until the copy is done, on CUDA until the copies are enqueued, and then the compute stream
waits for them on the GPU. Without `optimizer` the copy is made (CPU) or enqueued (CUDA) inside
`snapshot()`.

One sender thread then (CUDA: after the copies completed) streams the buffer to two keepers over
connections it keeps open (checkpointing.shard_stream: one socket copy into the keeper's own memory,
no object store), and the buffer is free again: the one on this rank's node and the next node's in
sorted order (one copy only when there is one node; said once in the log). On CPU the buffers are
shared-memory segments (checkpointing.shm_segment): this node's keeper keeps the segment itself as the
shard (no copy) until it frees it, and hands it back in a later answer (a buffer it keeps is not
written meanwhile: up to MAX_KEPT + 2 buffers); only the other node's copy crosses a socket. A keeper that died gets
its copy re-sent to the keeper started again under its name, else to the next one in the ring. No
collectives: each rank plans its own shard (checkpointing.memory_storage); resharding happens at
restore.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from ray.actor import ActorHandle
from ray.exceptions import RayActorError

from checkpointing import shm_segment
from checkpointing.memory_storage import ShardLayout, StagingPlan, flatten, pack_extras, slot_views
from checkpointing.naming import NAMESPACE, keeper_name
from checkpointing.shard_stream import MAX_KEPT, KeeperRefused, SegmentUnavailable, ShardStream, StreamBroken
from checkpointing.snapshot_restore import short_error

log = logging.getLogger("unbroken.snapshot")


__all__ = ["SnapshotClient", "SnapshotHandle", "SnapshotResult", "replica_nodes"]


def replica_nodes(node_name: str, nodes: list[str]) -> list[str]:
    """The keepers a rank on `node_name` sends to: its own node's, then the next node's in sorted order."""
    ordered = sorted(nodes)
    if node_name not in ordered:
        raise ValueError(
            f"node_name={node_name!r} has no keeper (keepers: {ordered}); call ensure_keepers first"
        )
    if len(ordered) == 1:
        return [node_name]
    return [node_name, ordered[(ordered.index(node_name) + 1) % len(ordered)]]


@dataclass
class SnapshotResult:
    step: int
    generation: int
    rank: int
    ok: bool  # every target keeper acknowledged its copy
    acked: list[str] = field(default_factory=list)  # nodes whose keeper holds the shard
    errors: dict[str, str] = field(default_factory=dict)  # node -> why its copy failed
    nbytes: int = 0
    blocking_s: float = 0.0  # the training thread's share in snapshot() (optimizer-step waits: copy_wait_s)
    send_s: float = 0.0  # background: object-store put and both keepers' acks


class SnapshotHandle:
    """A snapshot in flight; `result()` never raises keeper errors (they are in SnapshotResult)."""

    def __init__(self, step: int, generation: int, future: Future[SnapshotResult], blocking_s: float) -> None:
        self.step = step
        self.generation = generation
        self.blocking_s = blocking_s
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> SnapshotResult:
        return self._future.result(timeout)

    def add_done_callback(self, fn: Callable[[SnapshotResult], None]) -> None:
        """fn(result) on the sender thread once both keepers answered (or failed)."""
        self._future.add_done_callback(lambda f: fn(f.result()))


class _HostBuffer:
    """A host buffer with a typed view per tensor slot: pinned for CUDA copies; otherwise, where it can
    be, a shared-memory segment the keeper on this node copies from (checkpointing.shm_segment)."""

    def __init__(self, layout: ShardLayout, *, pin: bool, shared: bool) -> None:
        nbytes = max(layout.total_bytes, 1)
        self.segment: shm_segment.Segment | None = None
        if shared and not pin:
            try:
                self.segment = shm_segment.Segment.create(nbytes)
            except OSError as e:  # no /dev/shm, or too small: the bytes go over the socket
                log.warning("snapshot buffer of %d bytes not in shared memory (%s): sent over TCP", nbytes, e)
        if self.segment is not None:
            self.data: torch.Tensor = self.segment.tensor  # type: ignore[assignment]
        else:
            self.data = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.views = slot_views(self.data, layout)
        self.free = threading.Event()  # the sender is done with it
        self.free.set()
        self.lent = False  # this node's keeper keeps the segment as a shard's bytes: not written till released

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()


@dataclass
class _Staged:
    """One snapshot's shard once copied (CPU) or enqueued (CUDA) into a host buffer."""

    layout: ShardLayout
    layout_bytes: bytes
    extras: bytes
    buffer: _HostBuffer
    done: Any = None  # CUDA: torch.cuda.Event recorded after the copies


@dataclass
class _Frame:
    """What one keeper is sent for one snapshot (the same for both)."""

    header: dict[str, Any]
    layout: bytes
    extras: bytes
    blob: memoryview
    buffer: _HostBuffer  # where the blob lies (a shared-memory segment, for this node's keeper, or not)


def _ready_event(state: dict[str, Any]) -> Any:
    """CUDA: an event on the current stream after the optimizer step (the copies start after it)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return torch.cuda.current_stream().record_event()


class SnapshotClient:
    """One rank's sender. Build a new one after the group re-forms (new rank/world/generation)."""

    def __init__(
        self,
        job_id: str,
        rank: int,
        world_size: int,
        node_name: str,
        keepers: dict[str, ActorHandle],
        *,
        optimizer: torch.optim.Optimizer | None = None,
        timeout_s: float = 120.0,
        shared_memory: bool = True,
    ) -> None:
        """With `optimizer`, the copy overlaps the next step's forward/backward (parameters and
        optimizer state change only in optimizer.step(), whose pre-hook waits for the copy); without
        it, snapshot() copies (CPU) or enqueues the copies (CUDA) before returning. `shared_memory`: CPU
        buffers are /dev/shm segments this node's keeper keeps or copies from (else it is sent the bytes)."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} world_size={world_size}: need 0 <= rank < world_size")
        if not job_id:
            raise ValueError("job_id is empty")
        self.job_id = job_id
        self.rank = rank
        self.world_size = world_size
        self.node_name = node_name
        self.timeout_s = timeout_s
        self.keepers = dict(keepers)
        self.targets = replica_nodes(node_name, list(self.keepers))
        if len(self.targets) == 1:
            log.warning(
                "only one node (%s) has a keeper: snapshots are kept once, a node loss loses them", node_name
            )
        self._plan = StagingPlan()  # the layout and source tensors, kept while the state has the same tensors
        self._buffers: list[_HostBuffer] = []  # made on first use, again when the layout changes
        self._buffer_lock = threading.Lock()  # the buffers' `lent` (sender) against their choice (copier)
        self._buffer_freed = threading.Event()  # a send ended or the keeper gave segments back
        self._conns: dict[str, tuple[ActorHandle, ShardStream]] = {}  # node -> its keeper's open stream
        self._streams: dict[Any, Any] = {}  # device -> side torch.cuda.Stream
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"snapshot-r{rank}")
        self._copier: ThreadPoolExecutor | None = None
        self._pending_copy: Future[_Staged] | None = None
        self._hook: Any = None
        self.copy_wait_s = 0.0  # total host time the training thread waited for snapshot copies
        self.last_result: SnapshotResult | None = None
        self._rerouted: set[str] = set()  # nodes whose dead keeper's copies went elsewhere (logged once)
        # False: this node's keeper gets its copy over the socket too (shared_memory off, or it could not
        # open a segment)
        self._shared = shared_memory
        if optimizer is not None:
            self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"snapshot-copy-r{rank}")
            self._hook = optimizer.register_step_pre_hook(lambda *_: self.wait_copies())

    def set_keepers(self, keepers: dict[str, ActorHandle]) -> None:
        """Use another keeper set (after a node was lost or added); later snapshots go there."""
        self.keepers = dict(keepers)
        self.targets = replica_nodes(self.node_name, list(self.keepers))

    @property
    def overlapped(self) -> bool:
        """Whether copies run beside the next forward/backward (an optimizer was given)."""
        return self._copier is not None

    # ------------------------------------------------------------------ the training-path part
    def wait_copies(self) -> None:
        """Make what follows wait for the snapshot copy in flight (CPU: the host waits for the copy;
        CUDA: the host waits until it is enqueued, the current stream waits for it on the GPU). The
        optimizer's step pre-hook calls this; call it yourself before changing the state any other
        way (e.g. load_state_dict)."""
        pending, self._pending_copy = self._pending_copy, None
        if pending is None:
            return
        t0 = time.perf_counter()
        if pending.exception() is None:  # a failed copy is reported by the sender, never raised here
            done = pending.result().done
            if done is not None:
                torch.cuda.current_stream().wait_event(done)
        self.copy_wait_s += time.perf_counter() - t0

    @torch.no_grad()
    def snapshot(self, state: dict[str, Any], step: int, generation: int) -> SnapshotHandle:
        """Copy this rank's shard of `state` to host memory and send it to two keepers in the background.

        Call after the optimizer step, with a state dict built for this call (`trainer.state_dict()`):
        with `optimizer` its non-tensor values are read later, on the copier thread. Blocks only to
        hand it over (and for a copy still in flight, which the optimizer step normally waited for).
        """
        t0 = time.perf_counter()
        self.wait_copies()  # at most one copy in flight
        ready = _ready_event(state)
        copy: Future[_Staged]
        if self._copier is not None:
            copy = self._pending_copy = self._copier.submit(self._stage, state, ready)
        else:
            copy = Future()
            try:
                copy.set_result(self._stage(state, ready))
            except Exception as e:  # noqa: BLE001 - reported by the sender, like a background failure
                copy.set_exception(e)
            self._pending_copy = copy
            self.wait_copies()  # CUDA: later kernels of this stream wait for the copies (GPU-side)
        blocking = time.perf_counter() - t0
        fut = self._sender.submit(self._send, copy, int(step), int(generation), blocking)
        return SnapshotHandle(int(step), int(generation), fut, blocking)

    # ------------------------------------------------------------------ the copier's part
    @torch.no_grad()
    def _stage(self, state: dict[str, Any], ready: Any) -> _Staged:
        flat, _ = flatten(state)
        plan = self._plan
        if plan.update(state, flat):
            with self._buffer_lock:
                self._buffers = []  # (segments the keeper keeps stay mapped there)
        layout, sources = plan.layout, plan.sources
        assert layout is not None
        extras = pack_extras(flat, layout)
        cuda = [t for t in sources if t.device.type == "cuda"]
        buf = self._free_buffer(layout, pin=bool(cuda))
        try:
            if not cuda:
                # One call for every slot: a copy_ a tensor paid its dispatch per tensor (157 of them for
                # the debug preset: 0.52 ms a snapshot against 0.27, on this thread that shares the GIL).
                torch._foreach_copy_(buf.views, sources)
                return _Staged(layout, plan.layout_bytes, extras, buf)
            done = self._copy_cuda(buf, sources, ready, cuda[0].device)
        except BaseException:
            buf.free.set()  # the sender never gets this one: free it here, or the next copy waits for it
            raise
        return _Staged(layout, plan.layout_bytes, extras, buf, done)

    def _free_buffer(self, layout: ShardLayout, *, pin: bool) -> _HostBuffer:
        """A host buffer the sender is done with and this node's keeper does not keep (s+1 is copied
        while s is sent). Two to start with; more as the keeper keeps segments, at most MAX_KEPT + 2:
        then at least two are not kept (the keeper keeps MAX_KEPT at most, and says so in the answer that
        hands one back), and one of them is not being sent, so this never waits on the keeper."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            self._buffer_freed.clear()  # before looking: a send that ends after this wakes the wait below
            with self._buffer_lock:
                if not self._buffers:
                    self._buffers = [_HostBuffer(layout, pin=pin, shared=self._shared) for _ in range(2)]
                ready = [b for b in self._buffers if not b.lent and b.free.is_set()]
                if not ready and len(self._buffers) < MAX_KEPT + 2 and any(b.lent for b in self._buffers):
                    self._buffers.append(_HostBuffer(layout, pin=pin, shared=self._shared))
                    ready = self._buffers[-1:]
                if ready:
                    buf = ready[0]
                    buf.free.clear()
                    return buf
            # the sender frees one when its send ends (it sets the event after every send: _send)
            if not self._buffer_freed.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"no snapshot buffer came free within {self.timeout_s:.0f}s")

    def _copy_cuda(self, buf: _HostBuffer, sources: list[torch.Tensor], ready: Any, device: torch.device) -> Any:
        """Enqueue the device-to-host copies into the pinned buffer on a side stream (after `ready`);
        returns the event recorded after them."""
        with torch.cuda.device(device):  # the copier thread's current device is not the trainer's
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            if ready is not None:
                stream.wait_event(ready)  # the copies see the finished optimizer step
            with torch.cuda.stream(stream):
                for dst, src in zip(buf.views, sources, strict=True):
                    dst.copy_(src, non_blocking=src.is_cuda)  # CPU entries (e.g. RNG state) copy at once
                    if src.is_cuda:
                        src.record_stream(stream)  # not reused by the allocator before the copy ran
            return stream.record_event()

    # ------------------------------------------------------------------ the background part
    def _send(self, copy: Future[_Staged], step: int, generation: int, blocking: float) -> SnapshotResult:
        t0 = time.perf_counter()
        res = SnapshotResult(step, generation, self.rank, ok=False, blocking_s=blocking)
        try:
            staged = copy.result()
        except BaseException as e:
            res.errors["local"] = f"{type(e).__name__}: {e}"
            log.error("snapshot step %d rank %d: %s", step, self.rank, res.errors["local"])
            return res
        try:
            if staged.done is not None:  # CUDA: the copies must have landed before the bytes leave
                staged.done.synchronize()
            total = staged.layout.total_bytes
            header = {"job_id": self.job_id, "generation": generation, "step": step, "rank": self.rank,
                      "world_size": self.world_size}  # fmt: skip
            frame = _Frame(header, staged.layout_bytes, staged.extras,
                           memoryview(staged.buffer.data.numpy()).cast("B")[:total], staged.buffer)  # fmt: skip
            res.nbytes = total + len(staged.extras) + len(staged.layout_bytes)
            dead: list[str] = []
            for node in self.targets:
                try:
                    self._deliver(node, self.keepers[node], frame)
                    res.acked.append(node)
                except KeeperRefused as e:
                    res.errors[node] = f"{e.kind}: {e}"  # the keeper's own error, as it named it
                except Exception as e:  # noqa: BLE001 - reported in the result, never raised into training
                    res.errors[node] = short_error(e)
                    if isinstance(e, RayActorError):
                        dead.append(node)
            for node in dead:  # a keeper died between re-forms: the copy goes elsewhere, never left single
                took = self._resend(node, frame, res)
                if took is not None:
                    res.errors.pop(node)
                    res.acked.append(took)
        finally:
            staged.buffer.free.set()
            self._buffer_freed.set()
        res.ok = not res.errors
        res.send_s = time.perf_counter() - t0
        if not res.ok:
            log.error("snapshot step %d rank %d not held everywhere: %s", step, self.rank, res.errors)
        self.last_result = res
        return res

    def _deliver(self, node: str, handle: ActorHandle, frame: _Frame) -> None:
        """Stream one copy to `handle` (the keeper on `node`): over the open connection, else a new one
        (asking the keeper its address through Ray, which raises RayActorError if it is dead); a
        connection that broke is tried once more anew. KeeperRefused: the keeper said no (memory, fence)."""
        for attempt in range(2):
            held = self._conns.get(node)
            if held is None or held[0] != handle:
                if held is not None:
                    held[1].close()
                host, port, token = ray.get(handle.stream_address.remote(), timeout=self.timeout_s)
                held = self._conns[node] = (handle, ShardStream((host, port), token, self.timeout_s))
            segment = frame.buffer.segment
            shm = segment.name if segment is not None and node == self.node_name and self._shared else None
            try:
                held[1].send(frame.header, frame.layout, frame.extras, frame.blob, shm=shm, keep=shm is not None)
                if shm is not None and held[1].kept:
                    with self._buffer_lock:
                        frame.buffer.lent = True
                return
            except StreamBroken:  # (a KeeperRefused is the keeper's answer: it goes up as it is)
                self._conns.pop(node, None)
                if node == self.node_name:
                    self._forget_kept()
                if attempt:
                    raise
            except KeeperRefused as e:
                if e.kind != SegmentUnavailable.__name__:
                    raise
                self._shared = False  # e.g. a keeper in another container: this copy, and later ones, by TCP
                log.warning("snapshot rank %d: the keeper on %s cannot read shared memory (%s); sending it the "
                            "bytes", self.rank, node, e)
                self._deliver(node, handle, frame)
                return
            finally:
                self._take_back(held[1])

    def _forget_kept(self) -> None:
        """A connection to this node's keeper broke: it would hand its kept segments back on that
        connection, never on a new one. They are left to it (they may still be its shards' bytes; their
        pages go when it frees them) and new buffers are made as needed."""
        with self._buffer_lock:
            self._buffers = [b for b in self._buffers if not b.lent]

    def _take_back(self, stream: ShardStream) -> None:
        """The segments the keeper freed (their names came with its answers) may be written again."""
        if not stream.released:
            return
        names, stream.released = set(stream.released), []
        with self._buffer_lock:
            for b in self._buffers:
                if b.segment is not None and b.segment.name in names:
                    b.lent = False
        self._buffer_freed.set()

    def _resend(self, node: str, frame: _Frame, res: SnapshotResult) -> str | None:
        """The copy meant for `node`'s dead keeper: to the keeper started again there (the supervisor
        restarts a keeper whose node lives; found by name), else to the next node's in ring order that
        holds no copy yet. Returns the node that took it, or None (the error stays in `res`)."""
        try:
            fresh: ActorHandle | None = ray.get_actor(keeper_name(node), namespace=NAMESPACE)
        except ValueError:  # not started again (yet)
            fresh = None
        ordered = sorted(self.keepers)
        start = ordered.index(node)
        tries = [(node, fresh)] if fresh is not None and fresh != self.keepers[node] else []
        tries += [(n, self.keepers[n]) for n in ordered[start + 1:] + ordered[:start]
                  if n not in res.acked and n not in self.targets]  # fmt: skip
        for target, handle in tries:
            try:
                self._deliver(target, handle, frame)
            except Exception:  # noqa: BLE001 - the next one, else the first error stands
                continue
            if target == node:
                self.keepers[node] = handle  # the restarted keeper, from now on
            elif node not in self._rerouted:
                self._rerouted.add(node)
                log.warning("snapshot rank %d: the keeper on %s is gone; its copies go to %s's until it is "
                            "started again", self.rank, node, target)
            return target
        return None

    def _close_streams(self) -> None:
        for _handle, stream in self._conns.values():
            stream.close()
        self._conns.clear()
        for buf in self._buffers:
            buf.close()

    def abandon(self) -> None:
        """After a failure: remove the optimizer hook and stop the threads without waiting (a copy or
        send in flight finishes or fails on its own; its snapshot simply never gets committed)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._pending_copy = None
        if self._copier is not None:
            self._copier.shutdown(wait=False, cancel_futures=True)
        self._sender.shutdown(wait=False, cancel_futures=True)
        self._close_streams()  # a send in flight fails on its own: its snapshot is never committed

    def close(self) -> None:
        """Wait for the snapshots in flight, stop the threads, remove the optimizer hook."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        with contextlib.suppress(Exception):
            self.wait_copies()
        if self._copier is not None:
            self._copier.shutdown(wait=True)
        self._sender.shutdown(wait=True)
        self._close_streams()
