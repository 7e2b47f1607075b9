"""Calls on a cluster's set of keepers (checkpointing.keeper): start them, commit, ask, fence, free.

    keepers = ensure_keepers(["head", "b"], memory_limit_mb=cfg.keeper_memory_limit_mb)
    commit_snapshot(keepers, job_id, generation, step, world_size)   # supervisor, once all acked
    latest_committed(keepers, job_id)                                # -> step | None
    drop_job(keepers, job_id)                                        # job finished / cancelled
    find_keepers()                                                   # every keeper of the cluster, by name
    kill_keepers(keepers)                                            # tests, cluster teardown

Every call tolerates dead keepers where it can (reported, not raised), as a node may go at any time.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError

from checkpointing.keeper import KEEPER_CONCURRENCY, Keeper, SnapshotId
from checkpointing.naming import NAMESPACE, keeper_name
from checkpointing.nodes import node_ids_by_name

log = logging.getLogger("unbroken.keeper")


def start_keeper(node: str, node_id: str, memory_limit_mb: int = 4096) -> ActorHandle:
    """`keeper-<node>` on the Ray node `node_id`, created or found by name; returns at once (the
    process may still be starting: its first call waits for it)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return ray.remote(Keeper).options(
        name=keeper_name(node), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        max_concurrency=KEEPER_CONCURRENCY, max_restarts=0,
    ).remote(node, memory_limit_mb)  # fmt: skip


def ensure_keepers(
    node_names: list[str], *, memory_limit_mb: int = 4096, timeout_s: float = 60.0
) -> dict[str, ActorHandle]:
    """Create (or find) `keeper-<node>` on each named node; returns {node: handle} once all answer.

    Names are those of `current_node_name()`. An existing keeper keeps the memory limit it was created
    with. A node that is not alive (or unknown to Ray) raises ValueError; one whose keeper does not
    answer within timeout_s raises TimeoutError; one whose keeper died as it started (its node went
    meanwhile) raises KeepersNotStarted (a ValueError) with the keepers that did start.
    """
    if not node_names:
        raise ValueError("node_names is empty: name at least one node (see current_node_name)")
    ids = node_ids_by_name()
    unknown = sorted(set(node_names) - set(ids))
    if unknown:
        raise ValueError(f"nodes {unknown} are not alive in this Ray cluster (alive: {sorted(ids)})")
    handles = {node: start_keeper(node, ids[node], memory_limit_mb) for node in sorted(set(node_names))}
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
    return read_answers({node: getattr(h, method).remote(*args) for node, h in keepers.items()}, timeout_s)


def read_answers(refs: dict[str, Any], timeout_s: float) -> tuple[dict[str, Any], dict[str, str]]:
    """The keepers' answers to calls in flight ({node: ObjectRef}), waiting up to timeout_s for all;
    returns ({node: result}, {node: why it failed}): a late answer counts as failed."""
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    for node, ref in refs.items():
        try:
            results[node] = ray.get(ref, timeout=0.001)  # ready ones return at once; late ones fail
        except Exception as e:  # noqa: BLE001 - a dead or hung keeper is reported, not raised
            errors[node] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return results, errors


def required_copies(keepers: Collection[str]) -> int:
    """Two copies when there are two or more keepers (nodes, by name), else one."""
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
    min_copies: int | None = None, held_by: dict[int, list[str]] | None = None,
) -> bool:
    """Commit snapshot (generation, step) if every rank's shard is held on enough keepers.

    Enough = two distinct keepers (one when the cluster has a single node), or `min_copies` when given:
    a restore about to read the snapshot needs only one live copy of each shard (after a node loss the
    other copy of every shard it held is gone). Returns False, changing nothing, when some shard is
    still missing (not sent yet, refused, or its keeper died); True once every live holder has marked
    it committed (which frees older snapshots, see Keeper). `held_by` (rank -> nodes, as the ranks'
    acks say): the keepers are not asked first, so a commit is one round; a keeper that died since
    its ack fails the commit (raised), and the caller asks again without it.
    """
    if held_by is not None:
        held = held_on(keepers, held_by)
    else:  # each keeper answers for this snapshot only (its ring share): the cost grows with the nodes
        held, _errors = _call_all(keepers, "held", job_id, generation, step)
    nodes = commit_nodes(held, job_id, step, world_size, min_copies)
    if nodes is None:
        return False
    ray.get([keepers[n].commit.remote(job_id, generation, step) for n in nodes], timeout=30)
    return True


def held_on(keepers: dict[str, ActorHandle], held_by: dict[int, list[str]]) -> dict[str, list[int]]:
    """{node: ranks whose shard its keeper holds} from the ranks' acks (rank -> nodes), over `keepers`."""
    held: dict[str, list[int]] = {n: [] for n in keepers}
    for r, nodes in held_by.items():
        for n in set(nodes) & set(keepers):
            held[n].append(r)
    return held


def commit_nodes(held: dict[str, list[int]], job_id: str, step: int, world_size: int,
                 min_copies: int | None = None) -> list[str] | None:  # fmt: skip
    """The nodes whose keepers mark a snapshot committed, given what each live keeper holds of it
    (`held`: {node: ranks}, the keepers that answered), or None while some rank's shard lacks enough
    copies (commit_snapshot's rule). Sends nothing: a caller that must not wait for the keepers' answers
    (the supervisor's watch loop) sends the commits itself."""
    copies: dict[int, int] = {}
    for ranks in held.values():
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
    need = required_copies(held) if min_copies is None else min_copies
    if not held or any(copies.get(r, 0) < need for r in range(world_size)):
        return None
    return sorted(n for n, ranks in held.items() if ranks)


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


def keepers_holding(job_id: str, skip: Collection[str] = ()) -> dict[str, ActorHandle]:
    """The cluster's keepers (but those of `skip`) that hold some of the job's shards. Only those: a drop
    also empties a keeper's reuse pool, which other jobs' snapshots on that node would miss."""
    others = {n: h for n, h in find_keepers().items() if n not in skip}
    held = memory_reports(others, timeout_s=10.0) if others else {}
    return {n: others[n] for n, rep in held.items() if job_id in rep.get("jobs", {})}


def memory_reports(keepers: dict[str, ActorHandle], timeout_s: float = 30.0) -> dict[str, dict[str, Any]]:
    """{node: Keeper.memory_report()} of every live keeper (those answering within timeout_s)."""
    return _call_all(keepers, "memory_report", timeout_s=timeout_s)[0]
