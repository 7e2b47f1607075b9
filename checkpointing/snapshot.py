"""The in-memory snapshot tier, worker side: send a rank's shard to two keepers; restore from them.

    client = SnapshotClient(job_id, rank, world_size, node_name, keepers, optimizer=trainer.optimizer)
    handle = client.snapshot(trainer.state_dict(), trainer.step, generation)  # after the step
    handle.add_done_callback(lambda r: ...)   # r: SnapshotResult(ok, acked=[nodes], errors), on a thread
    ...train on...
    # supervisor, once every rank reported ok: keeper.commit_snapshot(keepers, job_id, generation, step, world)
    client.close()    # before the group re-forms or the state is replaced; build a new client after

    state = trainer.state_dict()                 # built for the NEW mesh (any dp degree)
    info = restore_from_keepers(keepers, job_id, state, step=step)   # no collectives; SnapshotLost
    info = restore_with_fallback(keepers, job_id, state, manager)    # collective: agrees, falls back
    trainer.load_state_dict(state)

Off the training path: `snapshot()` packs the few non-tensor values and starts copying the rank's
tensors into a reused host buffer: with `optimizer`, on CPU a copier thread copies while the next
forward/backward runs (they do not change parameters or optimizer state) and the optimizer's step
pre-hook waits for it; on CUDA the copies go to a pinned buffer on a side stream that the compute
stream waits for (GPU-side) before the next optimizer step. Without `optimizer` the CPU copy is made
inside the call. One background thread then puts the buffer into the object store once (after which
it is free again; there are two, so step s+1 can copy while step s is sent) and asks two keepers to
keep a copy: the one on this rank's node and the next node's in sorted order (one copy only when
there is one node; said once in the log). No collectives: each rank plans its own shard
(checkpointing.memory_storage) and resharding happens at restore.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ray.actor import ActorHandle

from checkpointing.keeper import SnapshotId, snapshot_holders
from checkpointing.memory_storage import (
    KeeperReader,
    ShardLayout,
    build_metadata,
    flatten,
    pack_extras,
    plan_layout,
    resolve,
    slot_views,
)

log = logging.getLogger("unbroken.snapshot")

__all__ = [
    "RestoreInfo",
    "SnapshotClient",
    "SnapshotHandle",
    "SnapshotLost",
    "SnapshotResult",
    "replica_nodes",
    "restore_from_keepers",
    "restore_with_fallback",
]


class SnapshotLost(RuntimeError):
    """No committed snapshot can be restored from the keepers (both copies of a shard are gone, or
    none was committed): fall back to the persistent checkpoint."""


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
    blocking_s: float = 0.0  # the training thread's share (wait for a free buffer + local copy)
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
        self.event: Any = None  # torch.cuda.Event recorded after the copies


def _bytes_view(t: torch.Tensor) -> Any:
    """A uint8 numpy view of a CPU tensor's data (a copy only if it is not contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def _put_views(sources: list[torch.Tensor]) -> ray.ObjectRef:
    """One object holding every tensor's bytes: Ray copies each straight into the object store
    (one memcpy in all, versus a host-buffer copy and then a put)."""
    return ray.put([_bytes_view(t) for t in sources])


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
        it, snapshot() copies before returning."""
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
        self._offsets: list[int] = []
        self._buffers: list[_HostBuffer] = []  # CUDA only, made on first use
        self._next = 0
        self._stream: Any = None
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"snapshot-r{rank}")
        self._copier: ThreadPoolExecutor | None = None
        self._pending_copy: Future[Any] | Any = None  # a Future (CPU) or a torch.cuda.Event
        self._hook: Any = None
        self.copy_wait_s = 0.0  # total time optimizer steps waited for snapshot copies
        self.last_result: SnapshotResult | None = None
        if optimizer is not None:
            self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"snapshot-copy-r{rank}")
            self._hook = optimizer.register_step_pre_hook(lambda *_: self.wait_copies())

    def set_keepers(self, keepers: dict[str, ActorHandle]) -> None:
        """Use another keeper set (after a node was lost or added); later snapshots go there."""
        self.keepers = dict(keepers)
        self.targets = replica_nodes(self.node_name, list(self.keepers))

    # ------------------------------------------------------------------ the training-path part
    def _ensure_layout(self, state: dict[str, Any], flat: dict[str, Any]) -> ShardLayout:
        from checkpointing.memory_storage import _signature

        if self._layout is not None and self._layout.signature == _signature(flat):
            return self._layout
        self._layout = plan_layout(state, flat)
        self._layout_bytes = self._layout.to_bytes()
        self._offsets = [s.offset for s in self._layout.slots]
        self._buffers = []
        return self._layout

    def wait_copies(self) -> None:
        """Make what follows wait for the snapshot copy in flight (CPU: the host waits; CUDA: the
        current stream waits on the GPU). The optimizer's step pre-hook calls this; call it yourself
        before changing the state any other way (e.g. load_state_dict)."""
        pending, self._pending_copy = self._pending_copy, None
        if pending is None:
            return
        if isinstance(pending, Future):
            t0 = time.perf_counter()
            pending.exception()  # a failed copy is reported by the sender, never raised here
            self.copy_wait_s += time.perf_counter() - t0
        else:
            torch.cuda.current_stream().wait_event(pending)

    @torch.no_grad()
    def snapshot(self, state: dict[str, Any], step: int, generation: int) -> SnapshotHandle:
        """Copy this rank's shard of `state` off the device and send it to two keepers in the background.

        Call after the optimizer step. Blocks for the copy, or (with `optimizer`) only to start it;
        on CUDA, if both pinned buffers are still being sent, until one is free.
        """
        t0 = time.perf_counter()
        self.wait_copies()  # at most one copy in flight
        flat, _ = flatten(state)
        layout = self._ensure_layout(state, flat)
        sources = [resolve(flat, layout.items[s.item]) for s in layout.slots]
        extras = pack_extras(flat, layout)
        job: tuple[str, Any]
        if any(t.device.type == "cuda" for t in sources):
            job = ("buffer", self._copy_cuda(sources, layout))
        elif self._copier is not None:
            self._pending_copy = self._copier.submit(_put_views, sources)
            job = ("future", self._pending_copy)
        else:
            job = ("ref", _put_views(sources))
        blocking = time.perf_counter() - t0
        fut = self._sender.submit(self._send, job, extras, int(step), int(generation), blocking)
        return SnapshotHandle(int(step), int(generation), fut, blocking)

    def _copy_cuda(self, sources: list[torch.Tensor], layout: ShardLayout) -> _HostBuffer:
        if not self._buffers:
            self._buffers = [_HostBuffer(layout) for _ in range(2)]
        buf = self._buffers[self._next]
        self._next = (self._next + 1) % len(self._buffers)
        buf.free.wait()
        buf.free.clear()
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        current = torch.cuda.current_stream()
        self._stream.wait_stream(current)  # the copies see the finished optimizer step
        with torch.cuda.stream(self._stream):
            for dst, src in zip(buf.views, sources, strict=True):
                dst.copy_(src, non_blocking=src.is_cuda)  # CPU entries (e.g. RNG state) copy at once
                if src.is_cuda:
                    src.record_stream(self._stream)
        buf.event = torch.cuda.Event()
        buf.event.record(self._stream)
        # Later kernels (the next optimizer step) must not overwrite what is still being copied;
        # the wait is on the GPU, the host goes on. With the optimizer hook, only its step waits.
        self._pending_copy = buf.event
        if self._hook is None:
            self.wait_copies()
        return buf

    # ------------------------------------------------------------------ the background part
    def _send(
        self, job: tuple[str, Any], extras: bytes, step: int, generation: int, blocking: float
    ) -> SnapshotResult:
        t0 = time.perf_counter()
        res = SnapshotResult(step, generation, self.rank, ok=False, blocking_s=blocking)
        kind, obj = job
        offsets: list[int] | None = self._offsets
        try:
            if kind == "buffer":  # CUDA: wait for the D2H copies, then one put of the laid-out buffer
                try:
                    obj.event.synchronize()
                    ref = ray.put(obj.data.numpy())
                    offsets = None
                finally:
                    obj.free.set()
            elif kind == "future":
                ref = obj.result()
            else:
                ref = obj
        except BaseException as e:
            res.errors["local"] = f"{type(e).__name__}: {e}"
            log.error("snapshot step %d rank %d: %s", step, self.rank, res.errors["local"])
            return res
        assert self._layout is not None
        total = self._layout.total_bytes
        res.nbytes = total + len(extras) + len(self._layout_bytes)
        calls = {
            node: self.keepers[node].put_shard.remote(
                self.job_id, generation, step, self.rank, self.world_size, self._layout_bytes, extras, ref,
                offsets, total,
            )
            for node in self.targets
        }  # fmt: skip
        del ref
        for node, call in calls.items():
            try:
                ray.get(call, timeout=self.timeout_s)
                res.acked.append(node)
            except Exception as e:  # noqa: BLE001 - reported in the result, never raised into training
                res.errors[node] = _short(e)
        res.ok = not res.errors
        res.send_s = time.perf_counter() - t0
        if not res.ok:
            log.error("snapshot step %d rank %d not held everywhere: %s", step, self.rank, res.errors)
        self.last_result = res
        return res

    def abandon(self) -> None:
        """After a failure: remove the optimizer hook and stop the threads without waiting (sends in
        flight finish or fail on their own; their snapshots simply never get committed)."""
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
        pending, self._pending_copy = self._pending_copy, None
        if isinstance(pending, Future):
            pending.exception()
        if self._copier is not None:
            self._copier.shutdown(wait=True)
        self._sender.shutdown(wait=True)


def _short(e: BaseException) -> str:
    """The root message of a (possibly Ray-wrapped) keeper error, one line."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        e = cause
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"


# ---------------------------------------------------------------------- restore
@dataclass
class RestoreInfo:
    source: str  # "keepers" or "persistent"
    job_id: str
    step: int
    generation: int | None
    world_size: int | None  # the world size the snapshot/checkpoint was taken at
    # snapshot rank -> the keeper node whose copy of that rank's tensors THIS rank read (ranks it needed)
    copies_used: dict[int, str] = field(default_factory=dict)
    single_copy_ranks: list[int] = field(default_factory=list)  # ranks with only one live copy left
    unreachable_keepers: dict[str, str] = field(default_factory=dict)  # node -> error
    fallback_reason: str | None = None  # why the keepers were not used (persistent source)
    uri: str | None = None  # the persistent checkpoint's location
    elapsed_s: float = 0.0

    def describe(self) -> str:
        if self.source == "keepers":
            used = ", ".join(f"rank {r}: keeper-{n}" for r, n in sorted(self.copies_used.items()))
            return (f"restored step {self.step} (generation {self.generation}, world {self.world_size}) from "
                    f"keepers [{used}]" + (f"; unreachable: {sorted(self.unreachable_keepers)}"
                                            if self.unreachable_keepers else ""))  # fmt: skip
        return f"restored step {self.step} from the persistent checkpoint {self.uri}; fell back because: {self.fallback_reason}"


def _candidates(
    committed: list[SnapshotId], step: int | None, generation: int | None, job_id: str
) -> list[SnapshotId]:
    """The committed snapshots that match step/generation (all when None), oldest first."""
    cands = [
        c for c in committed if (step is None or c[1] == step) and (generation is None or c[0] == generation)
    ]
    if not cands:
        what = "any step" if step is None else f"step {step}"
        what += f" generation {generation}" if generation is not None else ""
        raise SnapshotLost(
            f"job {job_id!r}: no committed in-memory snapshot of {what} on any live keeper "
            f"(committed: {committed}); restore from the persistent checkpoint"
        )
    return cands


def _fetch_iter(
    keepers: dict[str, ActorHandle], job_id: str, sid: SnapshotId, order: dict[int, list[str]],
    used: dict[int, str], timeout_s: float,
) -> Callable[[list[int]], Iterator[tuple[int, Any]]]:  # fmt: skip
    """A blob fetcher for KeeperReader: all requests in parallel, each rank from its first live holder."""

    def fetch(ranks: list[int]) -> Iterator[tuple[int, Any]]:
        tries = {r: list(order[r]) for r in ranks}
        pending: dict[Any, tuple[int, str]] = {}

        def ask(r: int) -> None:
            if not tries[r]:
                raise SnapshotLost(
                    f"job {job_id!r} step {sid[1]} (generation {sid[0]}): every copy of rank {r}'s shard is "
                    f"gone (tried {order[r]}); restore from the persistent checkpoint"
                )
            node = tries[r].pop(0)
            pending[keepers[node].get_blob.remote(job_id, sid[0], sid[1], r)] = (r, node)

        for r in ranks:
            ask(r)
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=timeout_s)
            if not done:
                raise SnapshotLost(f"job {job_id!r}: keepers did not answer within {timeout_s:.0f}s")
            r, node = pending.pop(done[0])
            try:
                blob = ray.get(ray.get(done[0])[0])
            except Exception as e:  # noqa: BLE001 - try the other copy
                log.warning(
                    "rank %d's shard from keeper-%s failed (%s); trying another copy", r, node, _short(e)
                )
                ask(r)
                continue
            used[r] = node
            yield r, blob

    return fetch


def restore_from_keepers(
    keepers: dict[str, ActorHandle],
    job_id: str,
    state: dict[str, Any],
    *,
    step: int | None = None,
    generation: int | None = None,
    prefer_node: str | None = None,
    timeout_s: float = 120.0,
) -> RestoreInfo:
    """Load a committed snapshot into `state` in place (resharding to its mesh); no collectives.

    `state` is built for the current mesh (e.g. `trainer.state_dict()` of a fresh Trainer). step=None
    takes the newest committed snapshot; pass the same step to every rank (the supervisor chooses).
    Each shard is read from `prefer_node`'s keeper if it holds a copy, else another live one.
    Raises SnapshotLost when no committed snapshot is complete on the live keepers.
    """
    t0 = time.perf_counter()
    holders, world, committed, unreachable = snapshot_holders(keepers, job_id)
    cands = _candidates(committed, step, generation, job_id)
    # The newest candidate with a live copy of every rank's shard (an older committed one may be
    # complete where the newest is not).
    problems: list[str] = []
    for sid in reversed(cands):
        held = holders.get(sid, {})
        w = world.get(sid)
        lost = [] if w is None else [r for r in range(w) if not held.get(r)]
        if w is not None and not lost:
            break
        what = "all ranks'" if w is None else f"rank(s) {lost}'s"
        problems.append(f"step {sid[1]} (generation {sid[0]}): every copy of {what} shards is gone")
    else:
        raise SnapshotLost(
            f"job {job_id!r}: no committed in-memory snapshot is complete on the live keepers ("
            + "; ".join(problems)
            + f"; unreachable keepers: {sorted(unreachable) or 'none'}); restore from the persistent checkpoint"
        )
    assert w is not None
    order = {r: sorted(held[r], key=lambda n: (n != prefer_node, n)) for r in range(w)}
    used: dict[int, str] = {}
    # Every rank's layout (small) builds the metadata: all asked at once, the other copy on failure.
    metas: dict[int, tuple[bytes, bytes, int]] = {}
    tries = {r: list(nodes) for r, nodes in order.items()}
    pending: dict[Any, int] = {}

    def ask_meta(r: int) -> None:
        if not tries[r]:
            raise SnapshotLost(
                f"job {job_id!r} step {sid[1]} (generation {sid[0]}): every copy of rank {r}'s shard is gone "
                f"(tried {order[r]}); restore from the persistent checkpoint"
            )
        node = tries[r].pop(0)
        pending[keepers[node].get_meta.remote(job_id, sid[0], sid[1], r)] = r

    for r in order:
        ask_meta(r)
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=timeout_s)
        if not done:
            raise SnapshotLost(f"job {job_id!r}: keepers did not answer within {timeout_s:.0f}s")
        r = pending.pop(done[0])
        try:
            metas[r] = ray.get(done[0])
        except Exception as e:  # noqa: BLE001 - try the other copy
            log.warning("rank %d's layout could not be read (%s); trying another copy", r, _short(e))
            ask_meta(r)
    layouts = {r: ShardLayout.from_bytes(m[0]) for r, m in metas.items()}
    extras = {r: pickle.loads(m[1]) for r, m in metas.items()}
    metadata, where = build_metadata(layouts)
    reader = KeeperReader(metadata, where, extras, _fetch_iter(keepers, job_id, sid, order, used, timeout_s))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to")
            dcp.load(state, storage_reader=reader, no_dist=True)
    except BaseException as e:  # DCP wraps failures in CheckpointException (a BaseException)
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        for cause in _causes(e):
            if isinstance(cause, SnapshotLost):
                raise cause from None
        raise
    return RestoreInfo(
        source="keepers", job_id=job_id, step=sid[1], generation=sid[0], world_size=w,
        copies_used=dict(sorted(used.items())),
        single_copy_ranks=[r for r in range(w) if len(held[r]) < min(2, len(keepers))],
        unreachable_keepers=unreachable, elapsed_s=time.perf_counter() - t0,
    )  # fmt: skip


def _causes(e: BaseException) -> list[BaseException]:
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        return [w[0] if isinstance(w, tuple) else w for w in failures.values()]
    return [e, *([e.__cause__] if e.__cause__ else [])]


def restore_with_fallback(
    keepers: dict[str, ActorHandle],
    job_id: str,
    state: dict[str, Any],
    manager: Any,
    *,
    step: int | None = None,
    generation: int | None = None,
    prefer_node: str | None = None,
    group: dist.ProcessGroup | None = None,
) -> RestoreInfo:
    """restore_from_keepers on every rank; if any rank hits SnapshotLost, all load the newest valid
    persistent checkpoint with `manager` (a checkpointing.persistent.CheckpointManager on the current
    group). Collective when torch.distributed is initialised: every rank must call it.
    """
    t0 = time.perf_counter()
    info: RestoreInfo | None = None
    why = ""
    try:
        info = restore_from_keepers(
            keepers, job_id, state, step=step, generation=generation, prefer_node=prefer_node
        )
    except SnapshotLost as e:
        why = str(e)
    reasons = [why]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, why, group=group)
        reasons = gathered
    failed = [r for r in reasons if r]
    if not failed and info is not None:
        return info
    reason = failed[0]
    log.warning(
        "job %s: in-memory snapshot unusable (%s); falling back to the persistent checkpoint", job_id, reason
    )
    ckpt = manager.load_latest(state)
    if ckpt is None:
        raise SnapshotLost(f"{reason}; and no valid persistent checkpoint under {manager.uri}")
    return RestoreInfo(
        source="persistent", job_id=job_id, step=ckpt.step, generation=ckpt.generation,
        world_size=ckpt.world_size, fallback_reason=reason, uri=getattr(ckpt, "uri", ckpt.root_uri),
        elapsed_s=time.perf_counter() - t0,
    )  # fmt: skip
