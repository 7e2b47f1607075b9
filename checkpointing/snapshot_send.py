"""The in-memory snapshot tier, send side: copy a rank's shard off the training path, send it to two keepers.

    client = SnapshotClient(job_id, rank, world_size, node_name, keepers, optimizer=trainer.optimizer)
    handle = client.snapshot(trainer.state_dict(), trainer.step, generation)  # after the step
    handle.add_done_callback(lambda r: ...)   # r: SnapshotResult(ok, acked=[nodes], errors), on a thread
    client.copy_wait_s                        # training-thread time optimizer steps waited for copies
    client.close()    # before the group re-forms or the state is replaced; build a new client after

The training thread only hands the state over (and, on CUDA, records an event after the optimizer
step). With `optimizer`, a copier thread does the rest while the next forward/backward runs (they
read parameters and optimizer state, never write them): flatten the state, plan the layout (once),
pickle the few non-tensor values, and copy the tensors. On CPU the copy is a put straight into the
object store (one memcpy per tensor). On CUDA the copies go to one of two pinned host buffers on a
side stream that first waits for the recorded event; the copier records a second event after them.
The optimizer's step pre-hook is the only place training waits: on CPU until the copy is done, on
CUDA until the copies are enqueued, and then the compute stream waits for them on the GPU.
Without `optimizer` the copy is made (CPU) or enqueued (CUDA) inside `snapshot()`.

One sender thread then (CUDA: after the copies completed, one put of the pinned buffer, which is then
free again) asks two keepers to keep a copy: the one on this rank's node and the next node's in sorted
order (one copy only when there is one node; said once in the log). No collectives: each rank plans
its own shard (checkpointing.memory_storage); resharding happens at restore.
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

from checkpointing.memory_storage import (
    ShardLayout,
    _signature,
    flatten,
    pack_extras,
    plan_layout,
    resolve,
    slot_views,
)
from checkpointing.naming import NAMESPACE, keeper_name
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
    """A pinned host buffer for the CUDA path, with a typed view per tensor slot."""

    def __init__(self, layout: ShardLayout) -> None:
        self.data = torch.empty(max(layout.total_bytes, 1), dtype=torch.uint8, pin_memory=True)
        self.views = slot_views(self.data, layout)
        self.free = threading.Event()
        self.free.set()


@dataclass
class _Staged:
    """One snapshot's shard once copied (CPU: in the object store) or enqueued (CUDA: to a pinned buffer)."""

    layout: ShardLayout
    layout_bytes: bytes
    extras: bytes
    ref: ray.ObjectRef | None = None  # CPU: every tensor's bytes, one object
    buffer: _HostBuffer | None = None  # CUDA: the pinned buffer being filled
    done: Any = None  # CUDA: torch.cuda.Event recorded after the copies


def _bytes_view(t: torch.Tensor) -> Any:
    """A uint8 numpy view of a CPU tensor's data (a copy only if it is not contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def _put_views(sources: list[torch.Tensor]) -> ray.ObjectRef:
    """One object holding every tensor's bytes: Ray copies each straight into the object store
    (one memcpy in all, versus a host-buffer copy and then a put)."""
    return ray.put([_bytes_view(t) for t in sources])


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
    ) -> None:
        """With `optimizer`, the copy overlaps the next step's forward/backward (parameters and
        optimizer state change only in optimizer.step(), whose pre-hook waits for the copy); without
        it, snapshot() copies (CPU) or enqueues the copies (CUDA) before returning."""
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
        self._layout: ShardLayout | None = None
        self._layout_bytes = b""
        self._buffers: list[_HostBuffer] = []  # CUDA only, made on first use
        self._next = 0
        self._streams: dict[Any, Any] = {}  # device -> side torch.cuda.Stream
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"snapshot-r{rank}")
        self._copier: ThreadPoolExecutor | None = None
        self._pending_copy: Future[_Staged] | None = None
        self._hook: Any = None
        self.copy_wait_s = 0.0  # total host time the training thread waited for snapshot copies
        self.last_result: SnapshotResult | None = None
        self._rerouted: set[str] = set()  # nodes whose dead keeper's copies went elsewhere (logged once)
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
        if self._layout is None or self._layout.signature != _signature(flat):
            self._layout = plan_layout(state, flat)
            self._layout_bytes = self._layout.to_bytes()
            self._buffers = []
        layout = self._layout
        sources = [resolve(flat, layout.items[s.item]) for s in layout.slots]
        staged = _Staged(layout, self._layout_bytes, pack_extras(flat, layout))
        cuda = [t for t in sources if t.device.type == "cuda"]
        if cuda:
            staged.buffer, staged.done = self._copy_cuda(sources, layout, ready, cuda[0].device)
        else:
            staged.ref = _put_views(sources)
        return staged

    def _copy_cuda(self, sources: list[torch.Tensor], layout: ShardLayout, ready: Any,
                   device: torch.device) -> tuple[_HostBuffer, Any]:  # fmt: skip
        """Enqueue the device-to-host copies into a free pinned buffer on a side stream (after `ready`)."""
        if not self._buffers:
            self._buffers = [_HostBuffer(layout) for _ in range(2)]  # s+1 copies while s is sent
        buf = self._buffers[self._next]
        self._next = (self._next + 1) % len(self._buffers)
        if not buf.free.wait(self.timeout_s):  # the sender is done with it (or was stopped: give up)
            raise TimeoutError(f"no pinned snapshot buffer came free within {self.timeout_s:.0f}s")
        buf.free.clear()
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
            done = stream.record_event()
        return buf, done

    # ------------------------------------------------------------------ the background part
    def _send(self, copy: Future[_Staged], step: int, generation: int, blocking: float) -> SnapshotResult:
        t0 = time.perf_counter()
        res = SnapshotResult(step, generation, self.rank, ok=False, blocking_s=blocking)
        offsets: list[int] | None = None
        try:
            staged = copy.result()
            if staged.buffer is not None:  # CUDA: wait for the copies, then one put of the laid-out buffer
                try:
                    staged.done.synchronize()
                    ref = ray.put(staged.buffer.data.numpy())
                finally:
                    staged.buffer.free.set()
            else:
                assert staged.ref is not None
                ref, staged.ref = staged.ref, None
                offsets = [s.offset for s in staged.layout.slots]
        except BaseException as e:
            res.errors["local"] = f"{type(e).__name__}: {e}"
            log.error("snapshot step %d rank %d: %s", step, self.rank, res.errors["local"])
            return res
        total = staged.layout.total_bytes
        res.nbytes = total + len(staged.extras) + len(staged.layout_bytes)
        args = (self.job_id, generation, step, self.rank, self.world_size, staged.layout_bytes, staged.extras,
                ref, offsets, total)  # fmt: skip
        calls = {node: self.keepers[node].put_shard.remote(*args) for node in self.targets}
        dead: list[str] = []
        for node, call in calls.items():
            try:
                ray.get(call, timeout=self.timeout_s)
                res.acked.append(node)
            except Exception as e:  # noqa: BLE001 - reported in the result, never raised into training
                res.errors[node] = short_error(e)
                if isinstance(e, RayActorError):
                    dead.append(node)
        for node in dead:  # a keeper died between re-forms: the copy goes elsewhere, never left single
            took = self._resend(node, args, res)
            if took is not None:
                res.errors.pop(node)
                res.acked.append(took)
        del ref, args
        res.ok = not res.errors
        res.send_s = time.perf_counter() - t0
        if not res.ok:
            log.error("snapshot step %d rank %d not held everywhere: %s", step, self.rank, res.errors)
        self.last_result = res
        return res

    def _resend(self, node: str, args: tuple[Any, ...], res: SnapshotResult) -> str | None:
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
                ray.get(handle.put_shard.remote(*args), timeout=self.timeout_s)
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
