"""The keeper: a detached, named Ray actor per node that holds in-memory snapshot shards.

    Keeper(node, memory_limit_mb)      # the actor class; checkpointing.keepers starts and calls them
    # workers: checkpointing.snapshot.SnapshotClient(...).snapshot(state, step, generation)

A keeper is `keeper-<node>` in namespace "unbroken", num_cpus=0, pinned to its node by Ray's node
affinity (the node's id, from Ray itself: no resource for a user to add), and threaded (max_concurrency > 1) so reads, commits and
reports run while a large shard is being received. Shards are keyed (job_id, generation, step, rank)
and stored as numpy arrays in the keeper's own heap, or (a shard from its own node's worker) as the
worker's shared-memory segment the keeper maps, so they outlive the worker that sent them.
Workers stream their shards straight into that memory over a TCP connection the keeper opens on its
node (`stream_address`, checkpointing.shard_stream), not through Ray's object store; `put_shard`
takes one through Ray (tools, tests).

Retention per job, applied at every commit: the last two committed snapshots stay; older committed
ones and uncommitted ones older than the newest commit are freed. "Older" orders by
(generation, step): a newer generation supersedes whatever an older one wrote.

Memory is bounded by `memory_limit_mb`; a shard that would not fit is refused with KeeperMemoryFull
(naming job, size, limit and the fix), never an out-of-memory crash of the node.
Fencing: `fence(job_id, generation)` (and every commit) raises the job's minimum generation; shards
from an older generation are refused with StaleGeneration and dropped if uncommitted.

This module imports ray (checkpointing's keepers are allowed to) but not torch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

# The names live in checkpointing.naming (CONTROL_RESOURCE is re-exported for older importers).
from checkpointing.naming import CONTROL_RESOURCE, NAMESPACE, NODE_RESOURCE_PREFIX, keeper_name  # noqa: F401
from checkpointing.nodes import (  # noqa: F401
    current_node_is_head,
    current_node_name,
    is_head,
    node_ids_by_name,
    node_name_of,
)

if TYPE_CHECKING:
    from checkpointing.shard_stream import Lend

log = logging.getLogger("unbroken.keeper")

KEEPER_CONCURRENCY = 16
KEEP_COMMITTED = 2

SnapshotId = tuple[int, int]  # (generation, step), ordered: newer generations supersede older ones
ShardKey = tuple[str, int, int, int]  # (job_id, generation, step, rank)


class KeeperMemoryFull(RuntimeError):
    """A shard does not fit in the keeper's memory limit."""


class StaleGeneration(RuntimeError):
    """A shard or commit from a generation older than the job's fence."""


@dataclass
class _Shard:
    blob: np.ndarray  # the rank's tensor bytes, owned by this process
    layout: bytes  # pickled write items and byte offsets (checkpointing.snapshot), small
    extras: bytes  # pickled non-tensor values, small
    world_size: int
    received_at: float
    readers: int = 0  # get_blob calls copying the blob out: it must not be reused meanwhile
    # A blob that is the worker's shared-memory segment (kept, not copied): called once it is freed and
    # no reader copies it, so the worker may write into the segment again (shard_stream's `released`).
    release: Callable[[], None] | None = None
    freed: bool = False

    @property
    def nbytes(self) -> int:
        return int(self.blob.nbytes) + len(self.layout) + len(self.extras)


# The keeper's memory, exported by the keeper itself on every change (one owner, no polling);
# workers/telemetry.py lists it with the runtime's other metrics for the dashboard.
MEMORY_METRIC = "unbroken_keeper_memory_bytes"
MEMORY_METRIC_HELP = "snapshot bytes held by a node's keeper"


def _memory_gauge() -> Any:
    """A Ray gauge where this process is connected to Ray, else None (a keeper used in-process)."""
    if not ray.is_initialized():
        return None
    from ray.util.metrics import Gauge

    return Gauge(MEMORY_METRIC, description=MEMORY_METRIC_HELP, tag_keys=("node",))


class Keeper:
    """The actor class (use ensure_keepers; `ray.remote` is applied there)."""

    def __init__(self, node: str, memory_limit_mb: int) -> None:
        if memory_limit_mb < 1:
            raise ValueError(
                f"memory_limit_mb={memory_limit_mb}: must be >= 1 (checkpoint.keeper_memory_limit_mb)"
            )
        self.node = node
        self.limit = int(memory_limit_mb) * 1024 * 1024
        self._gauge = _memory_gauge()
        self.used = 0
        self._lock = threading.Lock()
        self._shards: dict[ShardKey, _Shard] = {}
        self._committed: dict[str, list[SnapshotId]] = {}  # sorted, at most KEEP_COMMITTED
        self._fence: dict[str, int] = {}  # job -> minimum generation accepted
        self._refused = 0
        # Freed blobs of the same size are reused: a fresh 100 MB array costs page faults that
        # take as long as the copy itself. Pooled bytes count against the limit, and are dropped first.
        self._pool: dict[int, list[np.ndarray]] = {}
        self.pool_bytes = 0
        self._stream: Any = None  # checkpointing.shard_stream.ShardStreamServer, once asked for

    @property
    def used(self) -> int:
        """Bytes of shards held (and reserved for shards being received)."""
        return self._used

    @used.setter
    def used(self, nbytes: int) -> None:
        self._used = nbytes
        if self._gauge is not None:
            with contextlib.suppress(Exception):  # a failed export must not fail a snapshot
                self._gauge.set(float(nbytes), tags={"node": self.node})

    # ------------------------------------------------------------------ writing
    def stream_address(self) -> tuple[str, int, str]:
        """(host, port, token) of this keeper's shard stream (checkpointing.shard_stream), started on
        first use on the node's address: workers stream their snapshots there, not through Ray."""
        with self._lock:
            if self._stream is None:
                from checkpointing import shm_segment
                from checkpointing.shard_stream import ShardStreamServer

                shm_segment.sweep()  # segments of workers that died with an earlier keeper on this node
                host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
                self._stream = ShardStreamServer(self.receive_shard, host)
            return (*self._stream.address, self._stream.token)

    def receive_shard(
        self, header: dict[str, Any], layout: bytes, extras: bytes, fill: Callable[[np.ndarray], None],
        lend: Lend | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Store one shard from the stream: `fill(blob)` reads its bytes into the blob kept; with `lend`,
        the worker's segment itself is kept (lend() -> (its bytes, release))."""
        return self._store(header["job_id"], header["generation"], header["step"], header["rank"],
                           header["world_size"], layout, extras, header["blob"], fill, lend)  # fmt: skip

    def put_shard(
        self, job_id: str, generation: int, step: int, rank: int, world_size: int,
        layout: bytes, extras: bytes, data: np.ndarray | list[np.ndarray],
        offsets: list[int] | None = None, total: int | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Store one rank's shard (a copy) sent through Ray: `data` is the laid-out blob, or its pieces
        (uint8 arrays) to place at `offsets` in a blob of `total` bytes. Returns {"node", "nbytes",
        "used_bytes"}. Workers stream instead (stream_address); this is for tools and tests."""
        if offsets is None:
            assert isinstance(data, np.ndarray)
            pieces, offsets, blob_bytes = [data], [0], int(data.nbytes)
        else:
            assert isinstance(data, list) and total is not None and len(data) == len(offsets)
            pieces, blob_bytes = data, int(total)

        def fill(blob: np.ndarray) -> None:
            for piece, off in zip(pieces, offsets, strict=True):
                flat = piece.reshape(-1).view(np.uint8)
                blob[off : off + flat.nbytes] = flat

        return self._store(job_id, generation, step, rank, world_size, layout, extras, blob_bytes, fill)

    def _store(
        self, job_id: str, generation: int, step: int, rank: int, world_size: int,
        layout: bytes, extras: bytes, blob_bytes: int, fill: Callable[[np.ndarray], None],
        lend: Lend | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Reserve room (or refuse: fence, memory), let `fill` write the blob outside the lock (or take the
        lent segment as it is), keep it."""
        key = (job_id, int(generation), int(step), int(rank))
        size = int(blob_bytes) + len(layout) + len(extras)
        with self._lock:
            fence = self._fence.get(job_id, -1)
            if generation < fence:
                raise StaleGeneration(
                    f"keeper-{self.node}: job {job_id!r} is fenced at generation {fence}; refusing the "
                    f"shard of rank {rank} step {step} from generation {generation} (a stale worker)"
                )
            old = self._shards.get(key)
            free_after = self.limit - (self.used - (old.nbytes if old else 0))
            if size > free_after:
                self._refused += 1
                raise KeeperMemoryFull(
                    f"keeper-{self.node}: the snapshot shard of job {job_id!r} (rank {rank}, step {step}, "
                    f"{size / 2**20:.1f} MiB) does not fit: {self.used / 2**20:.1f} MiB of the "
                    f"{self.limit / 2**20:.0f} MiB limit in use. Raise checkpoint.keeper_memory_limit_mb, "
                    f"or lower the snapshot size per rank (raise checkpoint.in_memory_every so fewer "
                    f"snapshots are in flight, or shard the state over more ranks/nodes)"
                )
            self.used += size  # reserve before copying (a replaced old copy is released at the swap)
            pooled = self._take(int(blob_bytes)) if lend is None else None
        try:
            release = None
            if lend is not None:
                blob, release = lend()
            else:
                blob = pooled if pooled is not None else np.empty(int(blob_bytes), dtype=np.uint8)
                fill(blob)
            shard = _Shard(blob, layout, extras, int(world_size), time.time(), release=release)
        except BaseException:
            with self._lock:
                self.used -= size
            raise
        with self._lock:
            replaced = self._shards.get(key)
            if replaced is not None:
                self.used -= replaced.nbytes
                self._free_blob(replaced)
            self._shards[key] = shard
            # A commit may have happened meanwhile that makes this shard obsolete.
            self._apply_retention(job_id)
            return {"node": self.node, "nbytes": size, "used_bytes": self.used}

    # ------------------------------------------------------------------ committing
    def holdings(self, job_id: str) -> dict[str, Any]:
        """{"node", "shards": [(generation, step, rank, world_size)], "committed": [(generation, step)]}."""
        with self._lock:
            shards = [(g, s, r, sh.world_size) for (j, g, s, r), sh in self._shards.items() if j == job_id]
            return {
                "node": self.node,
                "shards": sorted(shards),
                "committed": list(self._committed.get(job_id, [])),
            }

    def held(self, job_id: str, generation: int, step: int) -> list[int]:
        """The ranks of one snapshot this keeper holds (its node's and the previous node's on the ring:
        checkpointing.ring): what a commit asks, O(ranks per node), not the keeper's whole holdings."""
        g, s = int(generation), int(step)
        with self._lock:
            return sorted(r for (j, gg, ss, r) in self._shards if j == job_id and gg == g and ss == s)

    def commit(self, job_id: str, generation: int, step: int) -> None:
        """Mark (generation, step) committed for the job, fence older generations, apply retention."""
        with self._lock:
            fence = self._fence.get(job_id, -1)
            if generation < fence:
                raise StaleGeneration(
                    f"keeper-{self.node}: job {job_id!r} is fenced at generation {fence}; generation "
                    f"{generation} may not commit step {step}"
                )
            ids = self._committed.setdefault(job_id, [])
            if (generation, step) not in ids:
                ids.append((int(generation), int(step)))
                ids.sort()
            del ids[:-KEEP_COMMITTED]
            self._fence[job_id] = max(fence, int(generation))
            self._apply_retention(job_id)

    def fence(self, job_id: str, generation: int) -> int:
        """Refuse shards from generations below `generation` and drop their uncommitted ones."""
        with self._lock:
            self._fence[job_id] = max(self._fence.get(job_id, -1), int(generation))
            self._apply_retention(job_id)
            return self._fence[job_id]

    def _apply_retention(self, job_id: str) -> None:
        """Caller holds the lock."""
        committed = self._committed.get(job_id, [])
        newest = committed[-1] if committed else None
        fence = self._fence.get(job_id, -1)
        for key in [k for k in self._shards if k[0] == job_id]:
            sid = (key[1], key[2])
            if sid in committed:
                continue
            if (newest is not None and sid < newest) or key[1] < fence:
                shard = self._shards.pop(key)
                self.used -= shard.nbytes
                self._free_blob(shard)

    def _free_blob(self, shard: _Shard) -> None:
        """A freed shard's blob: a kept segment goes back to its worker once nobody reads it; else the
        blob is kept for reuse if nobody reads it and it fits (caller holds the lock)."""
        shard.freed = True
        if shard.release is not None:
            self._give_back_unread(shard)
            return
        blob = shard.blob
        if shard.readers == 0 and self.used + self.pool_bytes + blob.nbytes <= self.limit:
            self._pool.setdefault(int(blob.nbytes), []).append(blob)
            self.pool_bytes += int(blob.nbytes)

    def _take(self, nbytes: int) -> np.ndarray | None:
        """A pooled blob of exactly nbytes, if any; trims the pool to the limit (caller holds the lock)."""
        same = self._pool.get(nbytes)
        blob = same.pop() if same else None
        if blob is not None:
            self.pool_bytes -= nbytes
        for size in sorted(self._pool, reverse=True):
            while self._pool[size] and self.used + self.pool_bytes > self.limit:
                self._pool[size].pop()
                self.pool_bytes -= size
        return blob

    # ------------------------------------------------------------------ reading
    def get_meta(self, job_id: str, generation: int, step: int, rank: int) -> tuple[bytes, bytes, int]:
        """(layout, extras, world_size) of one shard; KeyError if this keeper does not hold it."""
        shard = self._get(job_id, generation, step, rank)
        return shard.layout, shard.extras, shard.world_size

    def get_blob(self, job_id: str, generation: int, step: int, rank: int) -> list[ray.ObjectRef]:
        """[a ref to the blob], put by this keeper before returning: the put copies the blob while it
        is pinned against reuse (a return value would be copied after the method, unpinned)."""
        with self._lock:
            shard = self._shards.get((job_id, generation, step, rank))
            if shard is None:
                raise KeyError(
                    f"keeper-{self.node} holds no shard of job {job_id!r} gen {generation} step {step} rank {rank}"
                )
            shard.readers += 1
        try:
            return [ray.put(shard.blob)]
        finally:
            self._read_done(shard)

    def _read_done(self, shard: _Shard) -> None:
        with self._lock:
            shard.readers -= 1
            self._give_back_unread(shard)  # a kept segment freed while it was read: given back now

    @staticmethod
    def _give_back_unread(shard: _Shard) -> None:
        """A freed shard's kept segment goes back to its worker once no reader copies it, once (caller
        holds the lock)."""
        if shard.freed and shard.readers == 0 and shard.release is not None:
            shard.release()
            shard.release = None

    def _get(self, job_id: str, generation: int, step: int, rank: int) -> _Shard:
        with self._lock:
            shard = self._shards.get((job_id, generation, step, rank))
        if shard is None:
            raise KeyError(
                f"keeper-{self.node} holds no shard of job {job_id!r} gen {generation} step {step} rank {rank}"
            )
        return shard

    # ------------------------------------------------------------------ housekeeping
    def drop_job(self, job_id: str) -> int:
        """Free every shard of the job and forget it. Returns the bytes freed."""
        with self._lock:
            freed = 0
            for key in [k for k in self._shards if k[0] == job_id]:
                shard = self._shards.pop(key)
                freed += shard.nbytes
                self._free_blob(shard)
            self.used -= freed
            self._pool.clear()  # give the memory back (the pool is only a cache)
            self.pool_bytes = 0
            self._committed.pop(job_id, None)
            self._fence.pop(job_id, None)
            return freed

    def memory_report(self) -> dict[str, Any]:
        """{"node", "limit_bytes", "used_bytes", "pool_bytes", "refused", "frames",
        "jobs": {job: {"bytes", "shards", "committed"}}}; pool_bytes: freed blobs kept for reuse;
        frames: the shards streamed in so far by how their bytes came: {"kept" (the worker's segment kept
        as it is), "shared_memory" (copied out of it), "socket"}."""
        with self._lock:
            jobs: dict[str, dict[str, Any]] = {}
            for (j, g, s, r), sh in self._shards.items():
                e = jobs.setdefault(
                    j, {"bytes": 0, "shards": [], "committed": list(self._committed.get(j, []))}
                )
                e["bytes"] += sh.nbytes
                e["shards"].append((g, s, r))
            for e in jobs.values():
                e["shards"].sort()
            frames = dict(self._stream.frames) if self._stream is not None else {}
            return {"node": self.node, "limit_bytes": self.limit, "used_bytes": self.used,
                    "pool_bytes": self.pool_bytes, "refused": self._refused, "frames": frames,
                    "jobs": jobs}  # fmt: skip

    def ping(self) -> str:
        return self.node
