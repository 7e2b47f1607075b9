"""The in-memory snapshot tier, restore side: load a committed snapshot from the keepers (resharded).

    state = trainer.state_dict()                 # built for the NEW mesh (any dp degree)
    info = restore_from_keepers(keepers, job_id, state, step=step)   # no collectives; SnapshotLost
    info = restore_with_fallback(keepers, job_id, state, manager)    # collective: agrees, falls back
    trainer.load_state_dict(state)

Every rank's layout (small) is read first and merged into DCP metadata; the blobs are then fetched
in parallel, each from its first live holder (this node's keeper preferred), and DCP's load planner
reshards them into `state`. No collectives unless falling back to the persistent tier.
"""

from __future__ import annotations

import logging
import pickle
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import ray
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ray.actor import ActorHandle

from checkpointing.keeper import SnapshotId
from checkpointing.keepers import snapshot_holders
from checkpointing.memory_storage import KeeperReader, ShardLayout, build_metadata

log = logging.getLogger("unbroken.snapshot")

__all__ = ["RestoreInfo", "SnapshotLost", "restore_from_keepers", "restore_with_fallback", "short_error"]


class SnapshotLost(RuntimeError):
    """No committed snapshot can be restored from the keepers (both copies of a shard are gone, or
    none was committed): fall back to the persistent checkpoint."""



def short_error(e: BaseException) -> str:
    """The root message of a (possibly Ray-wrapped) keeper error, one line."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        e = cause
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"



@dataclass
class RestoreInfo:
    source: str  # "keepers", "persistent", or "peer" (checkpointing.peer_heal)
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
    phases: dict[str, float] = field(default_factory=dict)  # seconds: holders, layouts, load (keepers)

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


def _gone(sid: SnapshotId, whose: str) -> str:
    # One wording whether the listing or a later fetch finds the copies gone (a keeper killed just
    # now may still answer the listing).
    return f"step {sid[1]} (generation {sid[0]}): every copy of {whose} shards is gone"


def _copies_gone(job_id: str, sid: SnapshotId, rank: int, tried: list[str]) -> str:
    whose = f"rank(s) [{rank}]'s"
    return f"job {job_id!r} {_gone(sid, whose)} (tried {tried}); restore from the persistent checkpoint"


def _from_holders(
    keepers: dict[str, ActorHandle], job_id: str, sid: SnapshotId, order: dict[int, list[str]], ranks: list[int],
    ask: Callable[[ActorHandle, int], Any], take: Callable[[Any], Any], what: str, timeout_s: float,
) -> Iterator[tuple[int, str, Any]]:  # fmt: skip
    """(rank, node, answer) for each of `ranks`: all asked at once (`ask(keeper, rank)` -> a ref), each from
    its first live holder in `order`, another copy when one fails; `take(ref)` reads an answer."""
    tries = {r: list(order[r]) for r in ranks}
    pending: dict[Any, tuple[int, str]] = {}

    def send(r: int) -> None:
        if not tries[r]:
            raise SnapshotLost(_copies_gone(job_id, sid, r, order[r]))
        node = tries[r].pop(0)
        pending[ask(keepers[node], r)] = (r, node)

    for r in ranks:
        send(r)
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=timeout_s)
        if not done:
            raise SnapshotLost(f"job {job_id!r}: keepers did not answer within {timeout_s:.0f}s")
        r, node = pending.pop(done[0])
        try:
            answer = take(done[0])
        except Exception as e:  # noqa: BLE001 - try the other copy
            log.warning("rank %d's %s from keeper-%s failed (%s); trying another copy", r, what, node, short_error(e))
            send(r)
            continue
        yield r, node, answer


def _fetch_iter(
    keepers: dict[str, ActorHandle], job_id: str, sid: SnapshotId, order: dict[int, list[str]],
    used: dict[int, str], timeout_s: float,
) -> Callable[[list[int]], Iterator[tuple[int, Any]]]:  # fmt: skip
    """A blob fetcher for KeeperReader: all requests in parallel, each rank from its first live holder."""

    def fetch(ranks: list[int]) -> Iterator[tuple[int, Any]]:
        for r, node, blob in _from_holders(
                keepers, job_id, sid, order, ranks, lambda k, r: k.get_blob.remote(job_id, sid[0], sid[1], r),
                lambda ref: ray.get(ray.get(ref)[0]), "shard", timeout_s):
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
    known: tuple[int, dict[int, list[str]]] | None = None,
) -> RestoreInfo:
    """Load a committed snapshot into `state` in place (resharding to its mesh); no collectives.

    `state` is built for the current mesh (e.g. `trainer.state_dict()` of a fresh Trainer). step=None
    takes the newest committed snapshot; pass the same step to every rank (the supervisor chooses).
    Each shard is read from `prefer_node`'s keeper if it holds a copy, else another live one.
    `known` (world size, {rank: [nodes]}): who holds the committed (generation, step), as the supervisor
    just asked the keepers; then the keepers are not asked again (a copy gone since is tried, then the
    other). Raises SnapshotLost when no committed snapshot is complete on the live keepers.
    """
    t0 = time.perf_counter()
    if known is not None and step is not None and generation is not None:
        w, ranks = known
        holders = {(generation, step): {int(r): [n for n in nodes if n in keepers] for r, nodes in ranks.items()}}
        world, committed, unreachable = {(generation, step): int(w)}, [(generation, step)], {}
    else:
        holders, world, committed, unreachable = snapshot_holders(keepers, job_id)
    phases = {"holders_s": time.perf_counter() - t0}
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
        problems.append(_gone(sid, "all ranks'" if w is None else f"rank(s) {lost}'s"))
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
    metas: dict[int, tuple[bytes, bytes, int]] = {
        r: meta for r, _node, meta in _from_holders(
            keepers, job_id, sid, order, list(order), lambda k, r: k.get_meta.remote(job_id, sid[0], sid[1], r),
            ray.get, "layout", timeout_s)
    }  # fmt: skip
    layouts = {r: ShardLayout.from_bytes(m[0]) for r, m in metas.items()}
    extras = {r: pickle.loads(m[1]) for r, m in metas.items()}
    metadata, where = build_metadata(layouts)
    phases["layouts_s"] = time.perf_counter() - t0 - phases["holders_s"]
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
    elapsed = time.perf_counter() - t0
    phases["load_s"] = elapsed - phases["holders_s"] - phases["layouts_s"]
    return RestoreInfo(
        source="keepers", job_id=job_id, step=sid[1], generation=sid[0], world_size=w,
        copies_used=dict(sorted(used.items())),
        single_copy_ranks=[r for r in range(w) if len(held[r]) < min(2, len(keepers))],
        unreachable_keepers=unreachable, elapsed_s=elapsed, phases=phases,
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
    read: bool = True,
    known: tuple[int, dict[int, list[str]]] | None = None,
) -> RestoreInfo:
    """restore_from_keepers on every rank; if any rank hits SnapshotLost, all load the newest valid
    persistent checkpoint with `manager` (a checkpointing.persistent.CheckpointManager on the current
    group). Collective when torch.distributed is initialised: every rank must call it.

    `known`: who holds the snapshot, as the supervisor found it (see restore_from_keepers).
    read=False: this rank takes the snapshot from a replica instead (checkpointing.peer_heal); it reads
    nothing unless the fallback is taken, and gets a RestoreInfo with source "peer".
    """
    t0 = time.perf_counter()
    info: RestoreInfo | None = None
    why = ""
    if read:
        try:
            info = restore_from_keepers(
                keepers, job_id, state, step=step, generation=generation, prefer_node=prefer_node, known=known
            )
        except SnapshotLost as e:
            why = str(e)
    else:
        info = RestoreInfo(source="peer", job_id=job_id, step=-1 if step is None else step, generation=generation,
                           world_size=None)
    reasons = [why]
    t_agree = time.perf_counter()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, why, group=group)
        reasons = gathered
    failed = [r for r in reasons if r]
    if not failed and info is not None:
        info.phases["agree_s"] = time.perf_counter() - t_agree
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
