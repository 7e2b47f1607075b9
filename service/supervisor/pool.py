"""The replica pool: one placement group and tp x pp x cp worker actors per data-parallel replica.

A replica moves PENDING (reserved, waiting for its bundles) -> STARTING (workers created and warming
up: engine imported, data opened) -> READY (every worker answered, outside the group) -> ACTIVE (in
the current generation) -> back to READY between generations; DEAD once a member is lost or it is
dropped. Nothing here blocks: `advance` moves replicas along as far as they can go now.

Hot spares (resources.spares: K): the pool holds K READY replicas beyond the group's target, placed
on nodes other than the group's where the cluster allows (`choose_members` leaves the replicas on
other nodes out of the group; a replacement spare is asked for on the node holding the fewest of the
job's replicas). A failure re-forms the next generation with a spare in place of the lost replica.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import ray
from ray.exceptions import RayActorError

from checkpointing.naming import worker_name, worker_number, worker_prefix
from service.placement import ReplicaReservation, release, reserve_replica
from service.supervisor.context import JobRun
from service.supervisor.leftovers import named_actors, release_job_actors
from service.supervisor.ray_poll import ready_now
from service.supervisor.reporter import Reporter
from service.supervisor.words import first_line
from service.text import plural
from workers.protocol import RunResult, RunStatus
from workers.zygote_client import command as zygote_command
from workers.zygote_client import env_key


class ReplicaState(StrEnum):
    PENDING = "pending"
    STARTING = "starting"
    READY = "ready"  # a spare: every worker answered, not in the current generation
    ACTIVE = "active"
    DEAD = "dead"


# Where the live replicas are: counted against dp_max when asking for replacements.
LIVE = (ReplicaState.ACTIVE, ReplicaState.READY, ReplicaState.STARTING, ReplicaState.PENDING)


@dataclass
class Slot:
    """One worker actor."""

    name: str
    handle: Any
    replica: int
    local: int
    info_ref: Any = None
    info: dict[str, Any] | None = None
    rank: int = -1
    run_ref: Any = None
    result: RunResult | None = None  # what its run call of the current generation returned
    dead: str | None = None  # why, once it is known dead
    suspect_since: float | None = None

    @property
    def short(self) -> str:
        return self.name.rsplit("/", 1)[-1]

    @property
    def pid(self) -> int | None:
        """Its worker process's pid, once its info came."""
        pid = (self.info or {}).get("pid")
        return int(pid) if pid else None


@dataclass
class Replica:
    index: int
    res: ReplicaReservation | None
    slots: list[Slot] = field(default_factory=list)
    state: ReplicaState = ReplicaState.PENDING
    since: float = field(default_factory=time.monotonic)
    placed_name: str | None = None  # the node Ray placed its bundles on, once asked (ReplicaPool.waiting)
    placed_asked: bool = False  # Ray was asked where (once a replica: a look at two of its tables)

    @property
    def node(self) -> str | None:
        """The Ray node id its workers run on (STRICT_PACK: one node), once they answered."""
        info = self.slots[0].info if self.slots else None
        return str(info["node_id"]) if info and info.get("node_id") else None

    @property
    def node_name(self) -> str | None:
        info = self.slots[0].info if self.slots else None
        return str(info["node_name"]) if info and info.get("node_name") else None


def spares_wanted(run: JobRun) -> int:
    """The warm spare replicas the job keeps beside its group (resources.spares; service.sizing's rule)."""
    from service.sizing import spare_replicas

    return spare_replicas(run.spec)


def choose_members(ready: list[Replica], n: int, keep: Collection[int] = ()) -> list[Replica]:
    """The `n` replicas of `ready` that form the next generation; the others stay out as spares.

    The last generation's members (`keep`, by index) come first, so a swap changes only the lost
    replica. The rest are taken node by node: first from nodes the chosen members already use, then from
    the node holding the most of `ready`, so the replicas left out sit on other nodes than the group's
    wherever the placement allows (a node failure then does not take the group's replica and its spare).
    Ties go to the lower index."""
    chosen = sorted((r for r in ready if r.index in keep), key=lambda r: r.index)[:n]
    taken = {r.index for r in chosen}
    rest = [r for r in ready if r.index not in taken]
    per_node = Counter(r.node for r in ready)
    while len(chosen) < n and rest:
        used = {r.node for r in chosen}
        best = min(rest, key=lambda r: (r.node not in used or r.node is None, -per_node[r.node], r.index))
        chosen.append(best)
        rest = [r for r in rest if r.index != best.index]
    return chosen


class ReplicaPool:
    def __init__(self, run: JobRun, reporter: Reporter) -> None:
        self.run = run
        self.reporter = reporter
        self.replicas: dict[int, Replica] = {}
        self._next_replica = 0
        self._next_worker = 0

    @functools.cached_property
    def _runtime_env(self) -> dict[str, Any]:
        """The workers' runtime_env, fixed for the job's life: its zygote key (shared by jobs set up alike)
        stamps the engine's sources once, so a replacement started after an edit on disk forks from the
        same code as the ranks it joins."""
        spec = self.run.spec
        env = dict(spec.runtime_env.env_vars)
        env.update({k: v.get_secret_value() for k, v in spec.runtime_env.secret_env_vars.items()})
        env.setdefault("OMP_NUM_THREADS", "1")
        out: dict[str, Any] = {"env_vars": env}
        if spec.resources.fork_workers and sys.platform.startswith("linux"):
            out["py_executable"] = zygote_command(env_key(env))
        return out

    # ----------------------------------------------------------------- views
    def count(self, *states: ReplicaState) -> int:
        return sum(1 for r in self.replicas.values() if r.state in states)

    def in_state(self, state: ReplicaState) -> list[Replica]:
        return sorted((r for r in self.replicas.values() if r.state == state), key=lambda r: r.index)

    def active_slots(self) -> list[Slot]:
        return [s for r in self.replicas.values() if r.state == ReplicaState.ACTIVE for s in r.slots]

    # ----------------------------------------------------------------- growing the pool
    def request(self, prefer_node: str | None = None) -> Replica:
        """Reserve one more replica; `prefer_node` (a Ray node id) is a soft hint Ray follows if it can."""
        idx = self._next_replica
        self._next_replica += 1
        rep = Replica(idx, reserve_replica(self.run.job_id, idx, self.run.mp, self.run.per_worker,
                                           prefer_node=prefer_node))
        self.replicas[idx] = rep
        return rep

    def top_up(self) -> None:
        """Ask for replacements so active + spares + on the way reach dp_max plus the spares wanted (they
        start when capacity allows)."""
        while self.count(*LIVE) < self.run.dp_max + spares_wanted(self.run):
            self.request()

    def members(self, n: int, keep: Collection[int] = ()) -> list[Replica]:
        """The next generation's `n` replicas among the ACTIVE and READY ones (choose_members)."""
        live = self.in_state(ReplicaState.ACTIVE) + self.in_state(ReplicaState.READY)
        return choose_members(live, n, keep)

    def spares(self) -> list[Replica]:
        """READY replicas while a generation runs: warm, outside the group, ready to replace a lost one."""
        return self.in_state(ReplicaState.READY) if self.count(ReplicaState.ACTIVE) else []

    def active_nodes(self) -> set[str]:
        """The nodes the running group's replicas are on."""
        return {n for r in self.in_state(ReplicaState.ACTIVE) if (n := r.node_name)}

    def waiting(self) -> list[tuple[int, str]]:
        """(index, node name) of the replicas outside the group, starting or ready, whose node is known:
        where a swap or a grow will take a replica in, so that node's helpers can start ahead. A starting
        one's node is where Ray placed its bundles, asked once (only here: not for a job's first ranks)."""
        out: list[tuple[int, str]] = []
        for r in self.in_state(ReplicaState.STARTING) + self.in_state(ReplicaState.READY):
            if r.state == ReplicaState.STARTING and not r.placed_asked:
                r.placed_asked = True
                r.placed_name = _placed_name(r)
            if n := r.node_name or r.placed_name:
                out.append((r.index, n))
        return out

    def spare_node_hint(self) -> str | None:
        """Where a new spare should go: the live node that holds the fewest of the job's replicas (none,
        where one is free) among those whose resources cover a replica; None when no node qualifies."""
        need = {k: v * self.run.mp for k, v in self.run.per_worker.items() if v}
        held = Counter(n for r in self.replicas.values() if r.state in LIVE and (n := _placed_on(r)))
        try:
            nodes = [n for n in ray.nodes() if n.get("Alive")
                     and all(float(n.get("Resources", {}).get(k, 0.0)) + 1e-9 >= v for k, v in need.items())]
        except Exception:  # noqa: BLE001 - a hint only: Ray places the spare where it can
            return None
        if not nodes:
            return None
        best = min(nodes, key=lambda n: (held[n["NodeID"]], n["NodeID"]))
        return str(best["NodeID"])

    def _spawn(self, rep: Replica) -> None:
        from service.store import spec_to_private_json
        from workers.worker import Worker

        run = self.run
        assert rep.res is not None
        engine = spec_engine_json(run)
        ckpt = spec_to_private_json(run.spec.checkpoint)  # workers need the real S3 keys, not the mask
        runtime_env = self._runtime_env
        for local in range(run.mp):
            n = self._next_worker
            self._next_worker += 1
            name = worker_name(run.job_id, n)
            opts = {
                "job_id": run.job_id, "output_dir": str(run.output_dir),
                "heartbeat_interval_s": run.ft.heartbeat_interval_s,
                "collective_timeout_s": run.ft.collective_timeout_s, "keep_trainer": run.ft.keep_trainer,
                "chaos": [c.model_dump() for c in run.spec.chaos],
                "replica": rep.index, "local": local,
            }
            cls = ray.remote(Worker)
            handle = cls.options(
                name=name, namespace=run.namespace, lifetime="detached", max_concurrency=8, max_restarts=0,
                num_cpus=run.per_worker.get("CPU", 0.0), num_gpus=run.per_worker.get("GPU", 0.0),
                resources={k: v for k, v in run.per_worker.items() if k not in ("CPU", "GPU")} or None,
                scheduling_strategy=rep.res.strategy(local), runtime_env=runtime_env,
            ).remote(name, engine, ckpt, opts, run.self_handle)
            slot = Slot(name, handle, rep.index, local)
            slot.info_ref = handle.warm.remote()  # its info, once the engine is imported and the data open
            rep.slots.append(slot)
        rep.state = ReplicaState.STARTING
        rep.since = time.monotonic()

    def advance(self, *, spawn: bool = True) -> None:
        """Move replicas along without blocking: granted bundles get workers (unless `spawn` is False:
        they wait granted), started workers get ready."""
        for rep in list(self.replicas.values()):
            if rep.state == ReplicaState.PENDING and spawn and rep.res is not None and rep.res.ready(0):
                self._spawn(rep)
            elif rep.state == ReplicaState.STARTING:
                if len(ready_now(s.info_ref for s in rep.slots)) < len(rep.slots):
                    continue
                try:
                    for s in rep.slots:
                        s.info = ray.get(s.info_ref)
                    rep.state = ReplicaState.READY
                    started, rep.since = rep.since, time.monotonic()
                    took = rep.since - started  # from its workers' spawn (STARTING's since)
                    where = sorted({str(s.info.get("node_name")) for s in rep.slots if s.info})
                    self.reporter.event("replica_ready", f"Replica {rep.index} is ready: "
                                        f"{plural(self.run.mp, 'worker')} on node {', '.join(where)}, "
                                        f"{took:.2f}s after they were started.",
                                        replica=rep.index, nodes=where, start_s=round(took, 3))
                except RayActorError as e:
                    self.reporter.event("replica_failed", f"Replica {rep.index} failed to start: {first_line(e)}",
                                        replica=rep.index)
                    self.drop(rep)

    # ----------------------------------------------------------------- shrinking it
    def drop(self, rep: Replica, why: str = "dropped") -> None:
        self.retire(rep, why)
        for s in rep.slots:
            with contextlib.suppress(Exception):
                ray.kill(s.handle, no_restart=True)
        if rep.res is not None:
            release(rep.res)

    @staticmethod
    def retire(rep: Replica, why: str) -> None:
        """The bookkeeping of a drop (no Ray): every member marked dead, the replica DEAD."""
        for s in rep.slots:
            if s.dead is None:
                s.dead = why
        rep.state = ReplicaState.DEAD

    def kill(self, s: Slot, why: str) -> None:
        """A worker that must not take part again: marked dead and killed."""
        if s.dead is None:
            s.dead = why
        with contextlib.suppress(Exception):
            ray.kill(s.handle, no_restart=True)

    def write_off(self, s: Slot, why: str) -> None:
        """A culprit (maybe hung or stopped): killed, and SIGKILLed at once when it runs on this host."""
        self.kill(s, why)  # a hung worker's sockets close: its peers fail fast
        _sigkill_if_local(s)

    def write_off_on_lost_nodes(self, slots: list[Slot], generation: int, among: set[str] | None = None) -> None:
        """Those of `slots` on a node that is gone, of the Ray node ids `among` (default: any of theirs),
        are written off: dead, and SIGKILLed where local."""
        for s in on_lost_nodes(slots, among):
            s.result = s.result or RunResult(RunStatus.DEAD, s.name, generation, s.rank, 0, error="lost with its node")
            self.write_off(s, "lost with its node")

    def drop_ready_on_gone_nodes(self, lost: Collection[str] = (), members: Collection[int] = ()) -> None:
        """Before members are picked (a recovery from a node's loss, a grow): READY replicas (spares, or
        those about to join) on a node that is gone, one of `lost` (the Ray node ids lost) or another found
        gone now (checkpointing.nodes), are dropped. Their heartbeats would tell only after
        heartbeat_timeout_s; a generation launched with one would fail again at once, its other ranks
        waiting in the rendezvous for it. `members`: the indices of the failed generation's replicas (told
        as `replica_lost`, not as a spare's loss)."""
        ready = self.in_state(ReplicaState.READY)
        if not ready:
            return
        from checkpointing.nodes import dead_node_ids

        gone = set(lost)
        with contextlib.suppress(Exception):  # the GCS busy: the known ones only
            gone |= dead_node_ids({r.node for r in ready if r.node is not None})
        for rep in ready:
            if rep.node is not None and rep.node in gone:
                where = f"(node {rep.node_name or '?'})"
                kind, told = (("replica_lost", f"Replica {rep.index} {where}, a member of the group, was lost with "
                               "its node: it does not join the next generation.") if rep.index in members else
                              ("spare_lost", f"Spare replica {rep.index} {where} was lost with its node: dropped; "
                               "another is asked for."))
                self.reporter.event(kind, told, replica=rep.index, node=rep.node_name)
                self.drop(rep, "its node was lost")

    def release_all(self) -> None:
        """Workers and placement groups of the job: all go (also those an instance that crashed started)."""
        run = self.run
        for rep in self.replicas.values():
            for s in rep.slots:
                with contextlib.suppress(Exception):
                    ray.kill(s.handle, no_restart=True)
            if rep.res is not None:
                release(rep.res)
        release_job_actors(run.job_id, run.namespace)  # and by name: its node agents, what a crashed instance started

    # ----------------------------------------------------------------- after a supervisor restart
    def _named_workers(self) -> list[str]:
        return named_actors(worker_prefix(self.run.job_id), self.run.namespace)

    def adopt(self) -> tuple[int, list[int]]:
        """Find the job's workers by name, stop their generation, keep whole idle replicas as READY
        (with their placement groups), release the rest; returns the last generation they ran and the
        ranks of it no live worker holds."""
        run = self.run
        slots: list[Slot] = []
        for name in self._named_workers():
            with contextlib.suppress(Exception):
                h = ray.get_actor(name, namespace=run.namespace)
                info = ray.get(h.info.remote(), timeout=10)
                slots.append(Slot(name, h, int(info.get("replica", -1)), int(info.get("local", 0)), info=info))
                self._next_worker = max(self._next_worker, worker_number(name) + 1)
        last_gen = max([int(s.info["generation"]) for s in slots if s.info] + [0])
        # Ranks of that generation no live worker holds: lost while no supervisor watched (a dead actor's
        # name is gone, so only the survivors can say who is missing).
        members = {s.name: int(s.info["rank"]) for s in slots if s.info and int(s.info["generation"]) == last_gen}
        world = max([int(s.info.get("world_size") or 0) for s in slots if s.name in members] + [0])
        for s in slots:
            s.handle.abort.remote(last_gen)  # stop the generation the crashed instance ran
        deadline = time.monotonic() + run.ft.collective_timeout_s + 10
        while time.monotonic() < deadline:
            phases = []
            for s in slots:
                try:
                    s.info = ray.get(s.handle.info.remote(), timeout=5)
                    phases.append(s.info["phase"])
                except Exception:  # noqa: BLE001
                    s.dead = "gone"
            if all(p in ("idle", "finished") for p in phases):
                break
            time.sleep(0.2)
        # A worker that dies while we stop the generation (a fault that fired just then) is as lost.
        lost = sorted(set(range(world)) - {members[s.name] for s in slots if s.name in members and s.dead is None})
        by_rep: dict[int, list[Slot]] = {}
        for s in slots:
            if s.dead is None and s.info is not None and s.info["phase"] in ("idle", "finished"):
                by_rep.setdefault(s.replica, []).append(s)
            else:
                with contextlib.suppress(Exception):
                    ray.kill(s.handle, no_restart=True)
        from ray.util import get_placement_group

        from service.placement import job_placement_groups, replica_pg_name

        for idx, group in sorted(by_rep.items()):
            res = None
            with contextlib.suppress(Exception):  # the replica's detached group, found by name
                pg = get_placement_group(replica_pg_name(run.job_id, idx))
                res = ReplicaReservation(idx, pg, pg.ready())
            rep = Replica(idx, res, sorted(group, key=lambda s: s.local), state=ReplicaState.READY)
            if len(group) != run.mp:
                self.drop(rep, "incomplete replica after a supervisor restart")
                continue
            self.replicas[idx] = rep
            self._next_replica = max(self._next_replica, idx + 1)
        kept = {replica_pg_name(run.job_id, i) for i in self.replicas}
        for info in job_placement_groups(run.job_id):  # reservations without live workers
            if info.get("name") not in kept:
                with contextlib.suppress(Exception):
                    release(get_placement_group(info["name"]))
        return last_gen, lost


def on_lost_nodes(slots: list[Slot], among: set[str] | None = None) -> list[Slot]:
    """Those of `slots` whose node is gone (checkpointing.nodes.dead_node_ids), of the Ray node ids
    `among` (default: any of theirs); [] when the GCS does not answer (the callers' deadlines bound them)."""
    nodes = {str(s.info["node_id"]) for s in slots if s.info and s.info.get("node_id")}
    if among is not None:
        nodes &= among
    if not nodes:
        return []
    from checkpointing.nodes import dead_node_ids

    try:
        dead = dead_node_ids(nodes)
    except Exception:  # noqa: BLE001 - the GCS busy
        return []
    return [s for s in slots if (s.info or {}).get("node_id") in dead]


def _placed_on(rep: Replica) -> str | None:
    """The node a replica is on: its workers' answer, else (still starting) where Ray placed its bundles."""
    if rep.node or rep.res is None or rep.state == ReplicaState.PENDING:
        return rep.node
    with contextlib.suppress(Exception):
        placed = ray.util.placement_group_table(rep.res.pg).get("bundles_to_node_id") or {}
        return str(placed[0]) if placed.get(0) else None
    return None


def _placed_name(rep: Replica) -> str | None:
    """The name of the node a spawned replica's bundles are on (two reads of Ray's tables); None when Ray
    cannot say."""
    from checkpointing.nodes import node_ids_by_name

    node_id = _placed_on(rep)
    if node_id is None:
        return None
    with contextlib.suppress(Exception):
        return next((name for name, i in node_ids_by_name().items() if i == node_id), None)
    return None


def spec_engine_json(run: JobRun) -> str:
    """The engine config the workers build, with the job's own output folder."""
    from parallel.config import EngineConfig

    fields = set(EngineConfig.model_fields)
    data = {k: v for k, v in run.spec.model_dump(mode="json").items() if k in fields}
    data["training"]["output_dir"] = str(run.output_dir)
    return EngineConfig.model_validate(data).model_dump_json()


def _sigkill_if_local(s: Slot) -> None:
    """A SIGSTOPped worker answers no RPC, so Ray's kill may take long: SIGKILL it by PID when it is
    on this host (same hostname and Ray node IP), at once."""
    info = s.info or {}
    if not info.get("pid") or info.get("hostname") != socket.gethostname():
        return
    if info.get("node_ip") not in (None, ray.util.get_node_ip_address()):
        return
    with contextlib.suppress(OSError):
        os.kill(int(info["pid"]), signal.SIGKILL)
