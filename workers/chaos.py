"""Fault injection inside a worker, from a job's `chaos` list (like torchft's fail_at(rank, step)).

An event fires in the training loop of the worker that holds `rank` in `generation`, when that
worker has completed `step` steps (step 0: before the first step), so it fires once. One `at: join`
fires instead as that generation's group connects (`as_group_connects`: every rank has arrived, and
each waits in the store for the others' addresses): a rank lost in the middle of a re-form. With
`generation: null` it fires in whichever generation first reaches that rank and step, once per job
(claimed in Ray's KV store before it acts, so a rank re-running that step after a recovery, in
another process, does not fire it again): what a long soak with many faults needs, since it cannot
know the generations in advance.

- kill_worker: os._exit(1)                 - sigkill_worker: SIGKILL itself
- hang_worker: SIGSTOP itself (the train loop and the heartbeat thread both stop; only missed
  heartbeats can tell)
- kill_node: SIGKILL this node's raylet (RAY_RAYLET_PID: a forked worker's parent is its zygote); refused on
  the head node
- slow_worker: sleep `seconds` before every step from then on (a straggler)
- raise_in_step: raise ChaosError inside the step
- kill_keeper: kill the in-memory snapshot keeper of this worker's node (`keeper-<node>`); the
  job trains on, the supervisor starts the keeper again, and the copies go to another node's
  keeper meanwhile
- kill_supervisor: kill the job's supervisor actor (`job-<id>/supervisor`); Ray restarts it
  (fault_tolerance.supervisor_max_restarts) and it adopts the running workers
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("unbroken.chaos")

KINDS = ("kill_worker", "sigkill_worker", "hang_worker", "kill_node", "slow_worker", "raise_in_step",
         "kill_keeper", "kill_supervisor")
# The kinds that stop the rank they fire in, so its death or hang is theirs. The others pace it
# (slow_worker) or strike another process (the keeper, the supervisor) and leave the rank running.
STOPS_ITS_RANK = frozenset({"kill_worker", "sigkill_worker", "hang_worker", "kill_node", "raise_in_step"})


class ChaosError(RuntimeError):
    """An injected failure (raise_in_step), or a chaos event that cannot fire here."""


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int = 0
    seconds: float = 5.0
    generation: int | None = 0  # None: any generation, once per job
    index: int = 0  # its place in the job's chaos list (names its once-per-job claim)
    at: str = "step"  # "step": before step `step`; "join": as the generation's group connects

    @classmethod
    def from_dict(cls, d: dict[str, Any], index: int = 0) -> Fault:
        if d.get("kind") not in KINDS:
            raise ValueError(f"chaos kind {d.get('kind')!r} is not one of {KINDS}")
        if d.get("at", "step") not in ("step", "join"):
            raise ValueError(f"chaos at {d.get('at')!r} is not 'step' or 'join'")
        gen = d.get("generation", 0)
        return cls(str(d["kind"]), int(d.get("step", 0)), int(d.get("rank", 0)), float(d.get("seconds", 5.0)),
                   None if gen is None else int(gen), index, str(d.get("at", "step")))


def fault_place(at: str, step: int) -> str:
    """Where a fault fires, in words (the worker's log line, the supervisor's cause): "before step N" (1-based)
    or "as its group connects"."""
    return "as its group connects" if at == "join" else f"before step {step + 1}"


def claim_once(job_id: str, fault: Fault, token: str | None = None) -> bool:
    """True for the first worker of the job to claim this fault (Ray's KV store: put-if-absent). The value
    names the claimer (`token`, unique per call by default), and "already there" is read back: a put whose
    reply was lost and was retried finds its own claim, and must still fire rather than think another
    process fired it (a claim taken and no fault would leave the soak's fault unseen)."""
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_put

    key = f"chaos/{job_id}/{fault.index}"
    mine = token or f"{fault.kind}@{fault.step} by pid {os.getpid()} {uuid.uuid4().hex[:12]}"
    if not _internal_kv_put(key, mine, overwrite=False, namespace="unbroken"):
        return True
    held = _internal_kv_get(key, namespace="unbroken")
    return held is not None and held.decode() == mine


def forget_claims(job_id: str) -> int:
    """Drop a job's once-per-job claims (the soak's cleanup); how many there were."""
    from ray.experimental.internal_kv import _internal_kv_del

    return int(_internal_kv_del(f"chaos/{job_id}/", del_by_prefix=True, namespace="unbroken"))


def _job_id() -> str:
    """This worker's job, from its actor name `job-<id>/worker-<n>`."""
    import ray

    name = ray.get_runtime_context().get_actor_name() or ""
    if not name.startswith("job-") or "/" not in name:
        raise ChaosError(f"chaos: this process is not a job's worker actor (actor name {name!r})")
    return name[len("job-"):].split("/", 1)[0]


class Chaos:
    """The faults meant for one worker; `before_step` is called before each training step, and
    `as_group_connects` as each generation's group connects."""

    def __init__(
        self,
        faults: list[dict[str, Any]] | list[Fault],
        *,
        is_head_node: Callable[[], bool],
        on_fire: Callable[[Fault], None] | None = None,
        claim: Callable[[Fault], bool] | None = None,
    ) -> None:
        self.faults = [f if isinstance(f, Fault) else Fault.from_dict(f, i) for i, f in enumerate(faults)]
        self._is_head_node = is_head_node
        self._on_fire = on_fire
        self._claim = claim or (lambda f: claim_once(_job_id(), f))
        self._fired: set[Fault] = set()
        self.slow_s = 0.0

    def before_step(self, completed_steps: int, rank: int, generation: int) -> None:
        self._fire_due("step", completed_steps, rank, generation)
        if self.slow_s:
            time.sleep(self.slow_s)

    def as_group_connects(self, rank: int, generation: int) -> None:
        """Every rank of `generation` has arrived; the group's connections are about to form."""
        self._fire_due("join", 0, rank, generation)

    def _fire_due(self, at: str, completed_steps: int, rank: int, generation: int) -> None:
        for f in self.faults:
            if f in self._fired or (f.at, f.rank, f.step) != (at, rank, completed_steps):
                continue
            if f.generation is not None and f.generation != generation:
                continue
            self._fired.add(f)
            if f.generation is None and not self._claim(f):
                continue  # another process of this job fired it already
            self._fire(f)

    def _fire(self, f: Fault) -> None:
        if f.kind == "slow_worker":
            self.slow_s = f.seconds
        # A line in the job's logs (this process's output is the job's): the trace of a fault that no
        # failure shows, such as a keeper killed, or one that acted while the supervisor was restarting.
        log.warning("chaos: %s fires on rank %d %s", f.kind, f.rank, fault_place(f.at, f.step))
        sys.stdout.flush()
        if self._on_fire is not None:
            self._on_fire(f)  # a note (log line, fault time) before the process may vanish
        if f.kind == "kill_worker":
            os._exit(1)
        elif f.kind == "sigkill_worker":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.kind == "hang_worker":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif f.kind == "kill_node":
            if self._is_head_node():
                raise ChaosError("chaos kill_node: this worker runs on the head node; pick a rank on another node")
            # The raylet (the node's workers go with it): Ray names it to every worker; the parent of a worker
            # forked by its zygote (workers.zygote) is the zygote.
            os.kill(int(os.environ.get("RAY_RAYLET_PID") or os.getppid()), signal.SIGKILL)
            time.sleep(60)  # this process is about to be reaped with its node
        elif f.kind == "raise_in_step":
            raise ChaosError(f"injected fault (chaos raise_in_step) at step {f.step} on rank {f.rank}")
        elif f.kind in ("kill_keeper", "kill_supervisor"):
            _kill_service_actor(f.kind)


def _kill_service_actor(kind: str) -> None:
    """kill_keeper: this node's keeper (no Ray restart: the supervisor starts a new one); kill_supervisor: the job's
    supervisor, which Ray restarts. Both are killed as a crash would (no clean shutdown)."""
    import ray

    from checkpointing.naming import NAMESPACE, keeper_name, supervisor_name
    from checkpointing.nodes import current_node_name

    name = keeper_name(current_node_name()) if kind == "kill_keeper" else supervisor_name(_job_id())
    try:
        handle = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        raise ChaosError(f"chaos {kind}: no actor {name!r} to kill") from None
    ray.kill(handle, no_restart=kind == "kill_keeper")
