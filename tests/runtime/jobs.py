"""Helpers of the runtime tests: a tiny job spec, running it through a supervisor, leak checks."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import ray

TINY_MODEL = {"dim": 32, "n_layers": 1, "n_heads": 2, "vocab_size": 256, "max_seq_len": 32}


def tiny_spec(out: Path, *, steps: int = 8, dp: int = 4, tp: int = 1, dp_min: int = 1, chaos: list | None = None,
              cpus: float = 0.5, ft: dict | None = None, ckpt: dict | None = None) -> Any:  # fmt: skip
    from service.spec import parse_spec

    fault_tolerance = {
        "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 20, "collective_timeout_s": 20,
        "wait_for_capacity_s": 10, "max_recoveries": 5, **(ft or {}),
    }
    return parse_spec({
        "name": "rt",
        "model": TINY_MODEL,
        "training": {"steps": steps, "seq_len": 16, "global_batch_size": 8, "output_dir": str(out)},
        "parallelism": {"dp_shard": dp, "tp": tp, "sequence_parallel": False, "loss_parallel": False},
        "resources": {"cpus_per_worker": cpus, "dp": {"min": dp_min, "max": dp}},
        "checkpoint": {"persist_every": 0, "in_memory_every": 1, **(ckpt or {})},
        "fault_tolerance": fault_tolerance,
        "chaos": chaos or [],
    })


def paced(ranks: int, seconds: float) -> list[dict[str, Any]]:
    """Chaos that slows every rank alike (no straggler) by `seconds` before each step: a job that only has
    to keep running while a test acts on it, without the CPUs that jobs starting beside it need."""
    return [{"kind": "slow_worker", "step": 0, "rank": r, "seconds": seconds} for r in range(ranks)]


def worker_infos(job_id: str) -> list[dict[str, Any]]:
    """`Worker.info()` of each of a job's workers that answers (a dead or hung one is left out)."""
    import ray

    from checkpointing.naming import NAMESPACE

    found = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith(f"job-{job_id}/worker-"):
            try:
                found.append(ray.get(ray.get_actor(a["name"], namespace=NAMESPACE).info.remote(), timeout=2))
            except Exception:  # noqa: BLE001 - dead or hung
                continue
    return found


def engine_of(spec: Any) -> Any:
    """The engine part of a job spec (what the local launcher runs)."""
    from parallel.config import EngineConfig

    data = spec.model_dump(mode="json")
    return EngineConfig.model_validate({k: v for k, v in data.items() if k in EngineConfig.model_fields})


class JobRun:
    """A job run through `launch_supervisor` (no store): its events, final status and metrics rows."""

    def __init__(self, spec: Any, job_id: str | None = None) -> None:
        from service.supervisor import launch_supervisor

        self.job_id = job_id or uuid.uuid4().hex[:8]
        self.spec = spec
        self.handle = launch_supervisor(self.job_id, spec, store_url=None)
        self.events: list[dict[str, Any]] = []
        self.status: dict[str, Any] = {}

    def poll(self) -> list[dict[str, Any]]:
        try:
            new = ray.get(self.handle.events.remote(after=len(self.events)), timeout=30)
        except ray.exceptions.ActorUnavailableError:  # the supervisor is restarting
            time.sleep(0.5)
            return []
        self.events += new
        return new

    def wait(self, timeout_s: float = 400, on_event: Any = None) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for ev in self.poll():
                if on_event is not None:
                    on_event(ev)
            try:
                self.status = ray.get(self.handle.status.remote(), timeout=30)
            except ray.exceptions.ActorUnavailableError:  # the supervisor is restarting
                time.sleep(0.5)
                continue
            if self.status["done"]:
                self.poll()
                return self.status
            time.sleep(0.3)
        raise TimeoutError(f"job {self.job_id} not done after {timeout_s}s; events: {self.kinds()}")

    def finish(self) -> None:
        """Let the supervisor exit and wait until it is gone."""
        self.handle.shutdown.remote()
        deadline = time.monotonic() + 60
        from service.supervisor import find_supervisor

        while time.monotonic() < deadline and find_supervisor(self.job_id) is not None:
            time.sleep(0.2)

    def kinds(self) -> list[str]:
        return [e["kind"] for e in self.events]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind]

    def rows(self) -> list[dict[str, Any]]:
        path = Path(self.spec.training.output_dir) / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def assert_no_leaks(job_id: str) -> None:
    """No actor, placement group or keeper memory of the job is left."""
    from checkpointing.keeper import NAMESPACE, keeper_name

    deadline = time.monotonic() + 30
    while True:
        # Named actors that are not dead, from the GCS (the state API needs the dashboard).
        named = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        alive = [n for n in named if n.startswith(f"job-{job_id}/")]
        groups = [info for info in ray.util.placement_group_table().values()
                  if str(info.get("name", "")).startswith(f"job-{job_id}/") and info.get("state") != "REMOVED"]
        if not alive and not groups:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} leaked actors {alive} and placement groups {groups}")
        time.sleep(0.3)
    for name in named:
        if name.startswith("keeper-"):
            assert name == keeper_name(name[len("keeper-"):])
            try:
                held = ray.get(ray.get_actor(name, namespace=NAMESPACE).holdings.remote(job_id), timeout=30)
            except ray.exceptions.RayActorError:
                continue  # its node is gone, and its memory with it
            assert not held["shards"], f"{name} still holds shards of job {job_id}: {held}"


def assert_same_losses(rows: list[dict[str, Any]], ref: list[dict[str, Any]], tol: float = 1e-4) -> None:
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, len(ref) + 1)), f"each step once, in order: {steps}"
    for r, q in zip(rows, ref, strict=True):
        assert abs(r["loss"] - q["loss"]) <= tol, f"step {r['step']}: loss {r['loss']} vs fault-free {q['loss']}"
