"""SpareWatch's fallback where no node agent of the job's can be asked about a spare's process: the
spare is dropped once silent for over heartbeat_timeout_s, counted from its last heartbeat or from when
it became a spare, whichever came later (one that was never heard from is given the whole timeout).
Each spare is a real actor process that never reports; a dropped one is killed (SIGKILLed by pid, as
on the supervisor's host). The agents' path (a spare found dead or stopped within a heartbeat
interval) is proven on a real cluster in tests/runtime/test_spares.py."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

import ray

from service.spec import JobSpec
from service.supervisor.context import JobRun
from service.supervisor.pool import Replica, ReplicaPool, ReplicaState, Slot
from service.supervisor.reporter import Reporter
from service.supervisor.spare_watch import SpareWatch
from workers.protocol import Note

TIMEOUT_S = 20.0


@ray.remote(num_cpus=0)
class Quiet:
    """A spare's stand-in process that never heartbeats: all the watch sees of a spare is its silence."""

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "hostname": socket.gethostname(), "node_ip": ray.util.get_node_ip_address()}


def _watch(tmp_path: Path, spares: dict[str, tuple[float, float | None]]) -> tuple[JobRun, ReplicaPool,
                                                                                    SpareWatch, list[dict[str, Any]]]:
    """A job training at dp 1 with the given spares: name -> (s since it became a spare, s since its
    last heartbeat or None); the watch has no agents to ask."""
    spec = JobSpec.model_validate({"name": "silent", "fault_tolerance": {
        "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": TIMEOUT_S}})
    run = JobRun(job_id="j", spec=spec, namespace="t", store=None, restarted=False, self_handle=None, mp=1,
                 cp_tp=1, per_worker={"CPU": 1.0}, dp_min=1, dp_max=1, output_dir=tmp_path)  # fmt: skip
    pool = ReplicaPool(run, Reporter(run, None))
    pool.replicas[0] = Replica(0, None, [Slot("job-j/worker-0", None, 0, 0, rank=0)], ReplicaState.ACTIVE)  # no process
    now, mono = time.time(), time.monotonic()
    for i, (name, (spare_for, heard)) in enumerate(spares.items(), start=1):
        handle = Quiet.remote()
        slot = Slot(name, handle, i, 0, info=ray.get(handle.info.remote(), timeout=60))
        pool.replicas[i] = Replica(i, None, [slot], ReplicaState.READY, since=mono - spare_for)
        if heard is not None:
            run.hb[name] = (now - heard, Note(name, -1, -1, now - heard))
    events: list[dict[str, Any]] = []
    watch = SpareWatch(run, pool, lambda kind, message, **data: events.append(
        {"kind": kind, "message": message, "data": data}), agents=None)
    return run, pool, watch, events


def _gone(pid: int, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    return not os.path.exists(f"/proc/{pid}")


def test_a_silent_spare_is_dropped_and_a_heard_one_kept(local_ray: None, tmp_path: Path) -> None:
    _, pool, watch, events = _watch(tmp_path, {
        "job-j/worker-1": (60.0, 30.0),  # a spare for a minute, last heard 30 s ago: silent
        "job-j/worker-2": (60.0, 1.0),  # heard a second ago
        "job-j/worker-3": (60.0, None),  # never heard, a spare for a minute: silent
        "job-j/worker-4": (5.0, None),  # never heard, but a spare for 5 s only
        "job-j/worker-5": (5.0, 40.0),  # heard 40 s ago, but a spare for 5 s only: the wait counts from then
    })
    watch.check()
    lost = {e["data"]["worker"]: e for e in events if e["kind"] == "spare_lost"}
    assert set(lost) == {"job-j/worker-1", "job-j/worker-3"}, events
    for e in lost.values():
        assert e["data"]["how"] == "silent" and e["data"]["silent_s"] > TIMEOUT_S, e
        assert "was silent for" in e["message"] and "another is asked for" in e["message"], e["message"]
    states = {r.slots[0].name: r.state for r in pool.replicas.values()}
    assert states == {"job-j/worker-0": ReplicaState.ACTIVE, "job-j/worker-1": ReplicaState.DEAD,
                      "job-j/worker-2": ReplicaState.READY, "job-j/worker-3": ReplicaState.DEAD,
                      "job-j/worker-4": ReplicaState.READY, "job-j/worker-5": ReplicaState.READY}
    dropped = [s for r in pool.replicas.values() if r.state == ReplicaState.DEAD for s in r.slots]
    assert all(s.dead == "spare lost" and s.pid and _gone(s.pid) for s in dropped), dropped
    kept = [s for r in pool.replicas.values() if r.state == ReplicaState.READY for s in r.slots]
    assert all(s.pid and os.path.exists(f"/proc/{s.pid}") for s in kept), kept


def test_no_spare_is_dropped_while_the_group_is_not_training(local_ray: None, tmp_path: Path) -> None:
    """Between generations READY replicas are the next group's members, not spares: silence is the
    launch's to judge."""
    _, pool, watch, events = _watch(tmp_path, {"job-j/worker-1": (60.0, 30.0)})
    pool.replicas[0].state = ReplicaState.READY
    watch.check()
    assert events == [] and pool.replicas[1].state == ReplicaState.READY
