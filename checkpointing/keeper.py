"""The keeper: a detached, named Ray actor per node that holds in-memory snapshot shards.

    keepers = ensure_keepers(["head", "b"], memory_limit_mb=cfg.keeper_memory_limit_mb)
    # workers: checkpointing.snapshot.SnapshotClient(...).snapshot(state, step, generation)
    commit_snapshot(keepers, job_id, generation, step, world_size)   # supervisor, once all acked
    latest_committed(keepers, job_id)                                # -> step | None
    drop_job(keepers, job_id)                                        # job finished / cancelled
    find_keepers()                                                   # every keeper of the cluster, by name
    kill_keepers(keepers)                                            # tests, cluster teardown

A keeper is `keeper-<node>` in namespace "unbroken", num_cpus=0, pinned to its node by Ray's node
affinity (the node's id, from Ray itself: no resource for a user to add), and threaded (max_concurrency > 1) so reads, commits and
reports run while a large shard is being received. Shards are keyed (job_id, generation, step, rank)
and stored as numpy arrays in the keeper's own heap, so they outlive the worker that sent them.
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
from typing import Any

import numpy as np
import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError

# The names live in checkpointing.naming (CONTROL_RESOURCE is re-exported for older importers).
from checkpointing.naming import CONTROL_RESOURCE, NAMESPACE, NODE_RESOURCE_PREFIX, keeper_name  # noqa: F401
from checkpointing.nodes import (  # noqa: F401
    current_node_is_head,
    current_node_name,
    is_head,
    node_ids_by_name,
    node_name_of,
)

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
                from checkpointing.shard_stream import ShardStreamServer

                host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
                self._stream = ShardStreamServer(self.receive_shard, host)
            return (*self._stream.address, self._stream.token)

    def receive_shard(
        self, header: dict[str, Any], layout: bytes, extras: bytes, fill: Callable[[np.ndarray], None]
    ) -> dict[str, Any]:
        """Store one shard from the stream: `fill(blob)` reads its bytes into the blob kept."""
        return self._store(header["job_id"], header["generation"], header["step"], header["rank"],
                           header["world_size"], layout, extras, header["blob"], fill)  # fmt: skip

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
    ) -> dict[str, Any]:  # fmt: skip
        """Reserve room (or refuse: fence, memory), let `fill` write the blob outside the lock, keep it."""
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
            blob = self._take(int(blob_bytes))
        try:
            if blob is None:
                blob = np.empty(int(blob_bytes), dtype=np.uint8)
            fill(blob)
            shard = _Shard(blob, layout, extras, int(world_size), time.time())
        except BaseException:
            with self._lock:
                self.used -= size
            raise
        with self._lock:
            replaced = self._shards.get(key)
            if replaced is not None:
                self.used -= replaced.nbytes
                self._pool_blob(replaced)
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
                self._pool_blob(shard)

    def _pool_blob(self, shard: _Shard) -> None:
        """Keep a freed shard's blob for reuse if nobody reads it and it fits (caller holds the lock)."""
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
            with self._lock:
                shard.readers -= 1

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
                freed += self._shards.pop(key).nbytes
            self.used -= freed
            self._pool.clear()  # give the memory back (the pool is only a cache)
            self.pool_bytes = 0
            self._committed.pop(job_id, None)
            self._fence.pop(job_id, None)
            return freed

    def memory_report(self) -> dict[str, Any]:
        """{"node", "limit_bytes", "used_bytes", "pool_bytes", "refused",
        "jobs": {job: {"bytes", "shards", "committed"}}}; pool_bytes: freed blobs kept for reuse."""
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
            return {"node": self.node, "limit_bytes": self.limit, "used_bytes": self.used,
                    "pool_bytes": self.pool_bytes, "refused": self._refused, "jobs": jobs}  # fmt: skip

    def ping(self) -> str:
        return self.node


# ---------------------------------------------------------------------- driver/supervisor helpers
def ensure_keepers(
    node_names: list[str], *, memory_limit_mb: int = 4096, timeout_s: float = 60.0
) -> dict[str, ActorHandle]:
    """Create (or find) `keeper-<node>` on each named node; returns {node: handle} once all answer.

    Names are those of `current_node_name()`. An existing keeper keeps the memory limit it was created
    with. A node that is not alive (or unknown to Ray) raises ValueError; one whose keeper does not
    answer within timeout_s raises TimeoutError; one whose keeper died as it started (its node went
    meanwhile) raises KeepersNotStarted (a ValueError) with the keepers that did start.
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not node_names:
        raise ValueError("node_names is empty: name at least one node (see current_node_name)")
    ids = node_ids_by_name()
    unknown = sorted(set(node_names) - set(ids))
    if unknown:
        raise ValueError(f"nodes {unknown} are not alive in this Ray cluster (alive: {sorted(ids)})")
    actor_cls = ray.remote(Keeper)
    handles: dict[str, ActorHandle] = {}
    for node in sorted(set(node_names)):
        handles[node] = actor_cls.options(
            name=keeper_name(node), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(ids[node], soft=False),
            max_concurrency=KEEPER_CONCURRENCY, max_restarts=0,
        ).remote(node, memory_limit_mb)  # fmt: skip
    refs = {node: h.ping.remote() for node, h in handles.items()}
    ready, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    if pending:
        late = [n for n, r in refs.items() if r in pending]
        raise TimeoutError(f"keepers on nodes {late} did not start within {timeout_s:.0f}s: are those nodes alive?")
    died: dict[str, str] = {}
    for node, ref in refs.items():
        try:
            ray.get(ref)
        except RayActorError as e:  # its node died as the keeper started (a node lost and back meanwhile)
            died[node] = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    if died:
        raise KeepersNotStarted(
            f"the keepers on nodes {sorted(died)} died as they started ({next(iter(died.values()))}): "
            "are those nodes alive?", {n: h for n, h in handles.items() if n not in died})
    return handles


class KeepersNotStarted(ValueError):
    """Some keepers died as they started; `started` holds the others, which answered."""

    def __init__(self, message: str, started: dict[str, ActorHandle]) -> None:
        super().__init__(message)
        self.started = started


def find_keepers() -> dict[str, ActorHandle]:
    """{node: handle} of every keeper of the cluster (named `keeper-<node>` in the namespace), found by
    name: a job's end frees its memory also on keepers its supervisor no longer knows."""
    prefix = keeper_name("")
    out: dict[str, ActorHandle] = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        name = str(a.get("name", ""))
        if a.get("namespace") == NAMESPACE and name.startswith(prefix):
            with contextlib.suppress(ValueError):  # gone since the listing
                out[name[len(prefix):]] = ray.get_actor(name, namespace=NAMESPACE)
    return out


def alive_keepers(keepers: dict[str, ActorHandle], timeout_s: float = 5.0) -> dict[str, ActorHandle]:
    """The keepers that answer a ping within timeout_s (drop the others before snapshotting)."""
    results, _errors = _call_all(keepers, "ping", timeout_s=timeout_s)
    return {node: keepers[node] for node in results}


def kill_keepers(keepers: dict[str, ActorHandle]) -> None:
    """ray.kill every keeper (their memory is gone): for tests and cluster teardown."""
    for h in keepers.values():
        try:
            ray.kill(h, no_restart=True)
        except Exception as e:  # noqa: BLE001 - already dead is fine
            log.debug("kill keeper: %s", e)


def _call_all(
    keepers: dict[str, ActorHandle], method: str, *args: Any, timeout_s: float = 30.0
) -> tuple[dict[str, Any], dict[str, str]]:
    """Call a method on every keeper; returns ({node: result}, {node: why it failed})."""
    refs = {node: getattr(h, method).remote(*args) for node, h in keepers.items()}
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    for node, ref in refs.items():
        try:
            results[node] = ray.get(ref, timeout=0.001)  # ready ones return at once; late ones fail
        except Exception as e:  # noqa: BLE001 - a dead or hung keeper is reported, not raised
            errors[node] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return results, errors


def required_copies(keepers: dict[str, ActorHandle]) -> int:
    """Two copies when there are two or more keepers (nodes), else one."""
    return min(2, len(keepers))


def snapshot_holders(
    keepers: dict[str, ActorHandle], job_id: str
) -> tuple[dict[SnapshotId, dict[int, list[str]]], dict[SnapshotId, int], list[SnapshotId], dict[str, str]]:
    """What the live keepers hold for a job.

    Returns (holders {(gen, step): {rank: [nodes]}}, world {(gen, step): world_size},
    committed [(gen, step)] (union, sorted), unreachable {node: error}).
    """
    results, errors = _call_all(keepers, "holdings", job_id)
    holders: dict[SnapshotId, dict[int, list[str]]] = {}
    world: dict[SnapshotId, int] = {}
    committed: set[SnapshotId] = set()
    for node, h in sorted(results.items()):
        for g, s, r, w in h["shards"]:
            holders.setdefault((g, s), {}).setdefault(r, []).append(node)
            world[(g, s)] = w
        committed.update(tuple(c) for c in h["committed"])  # type: ignore[misc]
    return holders, world, sorted(committed), errors


def commit_snapshot(
    keepers: dict[str, ActorHandle], job_id: str, generation: int, step: int, world_size: int,
    min_copies: int | None = None,
) -> bool:
    """Commit snapshot (generation, step) if every rank's shard is held on enough keepers.

    Enough = two distinct keepers (one when the cluster has a single node), or `min_copies` when given:
    a restore about to read the snapshot needs only one live copy of each shard (after a node loss the
    other copy of every shard it held is gone). Returns False, changing nothing, when some shard is
    still missing (not sent yet, refused, or its keeper died); True once every live holder has marked
    it committed (which frees older snapshots, see Keeper).
    """
    # Each keeper answers for this snapshot only (its ring share), so a commit's cost grows with the
    # nodes, not with every shard every keeper holds.
    results, _errors = _call_all(keepers, "held", job_id, generation, step)
    copies: dict[int, int] = {}
    for ranks in results.values():
        for r in ranks:
            copies[r] = copies.get(r, 0) + 1
    extra = sorted(r for r in copies if r >= world_size)
    if extra:
        raise ValueError(
            f"commit_snapshot: world_size={world_size} but the keepers hold shards of ranks {extra[:4]} of job "
            f"{job_id!r} step {step}; pass the snapshot's world size"
        )
    # Copies on the keepers that answered: a dead keeper (killed, its node alive) must not stop every
    # commit until the next re-form replaces it; with one keeper left, one copy is all there can be.
    need = required_copies({n: keepers[n] for n in results}) if min_copies is None else min_copies
    if not results or any(copies.get(r, 0) < need for r in range(world_size)):
        return False
    nodes = sorted(n for n, ranks in results.items() if ranks)
    ray.get([keepers[n].commit.remote(job_id, generation, step) for n in nodes])
    return True


def committed_snapshots(keepers: dict[str, ActorHandle], job_id: str) -> list[SnapshotId]:
    """Committed (generation, step) of the job known to any live keeper, oldest first."""
    return snapshot_holders(keepers, job_id)[2]


def latest_committed(keepers: dict[str, ActorHandle], job_id: str) -> int | None:
    """The step of the job's newest committed snapshot, or None."""
    ids = committed_snapshots(keepers, job_id)
    return ids[-1][1] if ids else None


def fence_job(keepers: dict[str, ActorHandle], job_id: str, generation: int) -> None:
    """Tell every live keeper that `generation` is current: older ones' shards are refused."""
    _call_all(keepers, "fence", job_id, generation)


def drop_job(keepers: dict[str, ActorHandle], job_id: str) -> int:
    """Free a job's snapshots on every live keeper; returns the bytes freed."""
    results, _ = _call_all(keepers, "drop_job", job_id)
    return int(sum(results.values()))


def memory_reports(keepers: dict[str, ActorHandle], timeout_s: float = 30.0) -> dict[str, dict[str, Any]]:
    """{node: Keeper.memory_report()} of every live keeper (those answering within timeout_s)."""
    return _call_all(keepers, "memory_report", timeout_s=timeout_s)[0]
