"""A supervisor killed mid-job while its workers train on: the restarted one loses at most one step.

Notes are fire and forget, so the metrics rows and snapshot acks the ranks send while their supervisor
is down are lost with it. The restarted supervisor gets the rows back from the workers it adopts
(Worker.rows_after) and the snapshots from the keepers, so the new generation restores the step the
workers had reached (or the one before), not the crashed instance's last commit; and the job's count of
recoveries goes on from the store's.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.runtime.jobs import assert_no_leaks, assert_same_losses, engine_of, paced, tiny_spec

STEPS = 30  # the ranks must not reach the end while the supervisor is down


def _progress(store: Any, job_id: str) -> int:
    job = store.get_job(job_id)
    return int(((job.progress if job is not None else None) or {}).get("step", 0) or 0)


@pytest.mark.slow
def test_supervisor_killed_while_workers_train_on(head_cluster: Any, tmp_path: Path) -> None:
    import json

    import ray

    from checkpointing.naming import NAMESPACE, worker_prefix
    from parallel.layout_rules import engine_at_dp
    from service.store import JobStore
    from service.supervisor import find_supervisor, launch_supervisor
    from workers.launcher import run_local

    # Every rank's step takes ~0.4 s, so the ranks train on for several steps while the supervisor is
    # down; rank 1's step 3 raises first: one recovery, counted before the restart.
    slow = paced(2, 0.4)
    # And from step 6 a line in the job's logs at every step of rank 0 (each fault once per job): those
    # printed while the supervisor is down must reach the logs too (Worker.lines_after).
    marks = [{"kind": "slow_worker", "step": s, "rank": 0, "seconds": 0.4, "generation": None}
             for s in range(6, STEPS - 1)]
    spec = tiny_spec(tmp_path / "job", steps=STEPS, dp=2, dp_min=1,
                     chaos=[*slow, *marks, {"kind": "raise_in_step", "step": 2, "rank": 1}])
    clean = tiny_spec(tmp_path / "ref", steps=STEPS, dp=2, dp_min=1)
    # The fault-free run in one process (the loss does not depend on dp: batch invariance).
    ref_run = run_local(engine_at_dp(engine_of(clean), 1), 1, tmp_path / "ref", show_progress=False)
    reference = [json.loads(x) for x in Path(ref_run.metrics_path).read_text().splitlines()]

    store = JobStore(f"sqlite:///{tmp_path / 'jobs.db'}")
    rec, _ = store.create_job(spec, "alice", min_world=1, max_world=2)
    assert store.mark_admitted(rec.id)
    launch_supervisor(rec.id, spec, store_url=store.url)
    deadline = time.monotonic() + 300
    def at_dp2_after_recovery() -> bool:  # rank 1 exists again (the recovery may have shrunk the job to 1)
        evs = store.events(rec.id)
        gens = [e for e in evs if e.kind == "generation"]
        return any(e.kind == "recovered" for e in evs) and bool(gens) and gens[-1].data.get("dp") == 2

    while not at_dp2_after_recovery() or _progress(store, rec.id) < 6:
        assert time.monotonic() < deadline, [(e.kind, e.message) for e in store.events(rec.id)]
        time.sleep(0.2)
    # The supervisor hangs for 3 s (the ranks train on; their notes wait unread), then crashes: Ray
    # restarts it, and whatever the hung instance had not read is lost with it. Rank 1's worker is
    # SIGKILLed while no supervisor watches: the restarted one must find it gone and say so.
    pid, torch_in = ray.get(find_supervisor(rec.id).__ray_call__.remote(
        lambda self: (os.getpid(), "torch" in sys.modules)), timeout=60)
    # Two launches in, the supervisor has not imported torch (its rules are torch-free: importing it for
    # the collective timeout cost ~1 s before every job's first generation).
    assert not torch_in, "the supervisor imported torch"
    os.kill(pid, signal.SIGSTOP)
    workers = [ray.get_actor(a["name"], namespace=NAMESPACE) for a in ray.util.list_named_actors(all_namespaces=True)
               if a.get("namespace") == NAMESPACE and str(a.get("name", "")).startswith(worker_prefix(rec.id))]
    infos = ray.get([w.info.remote() for w in workers], timeout=30)
    gen = max(int(i["generation"]) for i in infos)
    stopped_at, until = max(int(i["step"]) for i in infos), time.monotonic() + 30
    while max(int(i["step"]) for i in infos) < stopped_at + 3 and time.monotonic() < until:
        time.sleep(0.2)  # the ranks train on, unwatched, for a few steps
        infos = ray.get([w.info.remote() for w in workers], timeout=30)
    rank1 = [int(i["pid"]) for i in infos if (i["generation"], i["rank"]) == (gen, 1)]
    assert rank1, infos
    os.kill(rank1[0], signal.SIGKILL)
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    while not (job := store.get_job(rec.id)) or not job.terminal:
        assert time.monotonic() < deadline, [(e.kind, e.message) for e in store.events(rec.id)]
        time.sleep(0.5)
    events = store.events(rec.id)
    said = [(e.kind, e.message) for e in events]
    assert job.status == "SUCCEEDED", said
    kinds = [e.kind for e in events]
    assert "supervisor_restarted" in kinds, said
    adopted = next(e for e in events if e.kind == "adopted")
    reached, rows_back = int(adopted.data["step"]), int(adopted.data["rows_recovered"])
    # What this test is about: the crashed instance never wrote rows the workers sent while it was down.
    assert rows_back >= 2, f"the workers did not train on while the supervisor was down: {adopted.message}"
    assert adopted.data["lost_ranks"] == [1] and "rank(s) 1 of it died" in adopted.message, adopted.message
    after = kinds.index("adopted")
    gen = next(e for e in events[after:] if e.kind == "generation")
    assert gen.data["restore"]["step"] >= reached - 1, (gen.message, adopted.message)
    rec_ev = next(e for e in events[after:] if e.kind == "recovered")
    print(f"\n{adopted.message}\n{gen.message}\n{rec_ev.message}")
    assert rec_ev.data["kind"] == "supervisor_restarted" and rec_ev.data["lost_steps"] <= 1, rec_ev.message
    # The restarted instance timed the re-form's pause (its clock set by the rows the workers gave back;
    # without them, by the last row its predecessor wrote: test_reporter_rows), and the job's goodput
    # counts it under its cause.
    assert isinstance(rec_ev.data.get("pause_s"), float) and rec_ev.data["pause_s"] > 0, rec_ev.data
    from service.goodput import job_goodput

    good = job_goodput(store, rec.id)
    assert good.by_cause.get("supervisor_restarted") == pytest.approx(rec_ev.data["pause_s"]), good
    for e in events:
        if e.kind == "recovered":
            assert e.data["lost_steps"] <= 1, e.message
    # The count of recoveries went on across the restart (1: the raise in rank 1's step).
    finished = next(e for e in events if e.kind == "finished")
    assert finished.data["recoveries"] == 1 == store.get_job(rec.id).recoveries, finished.message
    assert_same_losses(sorted(store.metrics(rec.id), key=lambda r: r["step"]), reference)
    lines = [x.line for x in store.logs(rec.id, limit=100_000)]
    missing = [m["step"] for m in marks if not any(f"slow_worker fires on rank 0 before step {m['step'] + 1}" in x
                                                   for x in lines)]
    assert not missing, f"output lines of steps {missing} never reached the logs ({adopted.message})"
    assert int(adopted.data["lines_recovered"]) >= 1, adopted.message
    rows = [json.loads(x) for x in (tmp_path / "job" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    deadline = time.monotonic() + 60
    while find_supervisor(rec.id) is not None and time.monotonic() < deadline:
        time.sleep(0.3)
    assert_no_leaks(rec.id)


def test_a_jobs_end_frees_its_shards_on_keepers_its_supervisor_does_not_know(head_cluster: Any,
                                                                           tmp_path: Path) -> None:
    """A keeper the supervisor no longer knows (its node written off, or known only to the instance
    before a restart) still holds the job's shards: the job's end frees them there too, and leaves
    another job's shards alone."""
    import numpy as np
    import ray

    from checkpointing.keepers import ensure_keepers
    from checkpointing.nodes import current_node_name
    from service.spec import JobSpec
    from service.supervisor.committer import SnapshotCommitter
    from service.supervisor.context import JobRun
    from service.supervisor.reporter import Reporter

    node = ray.get(ray.remote(num_cpus=0)(current_node_name).remote())
    keeper = ensure_keepers([node], memory_limit_mb=64)[node]
    for job in ("gone-job", "other-job"):
        ray.get(keeper.put_shard.remote(job, 0, 1, 0, 1, b"", b"", np.zeros(1024, dtype=np.uint8)))
    run = JobRun(job_id="gone-job", spec=JobSpec.model_validate({"name": "gone"}), namespace="t", store=None,
                 restarted=True, self_handle=None, mp=1, cp_tp=1, per_worker={"CPU": 1.0}, dp_min=1, dp_max=1,
                 output_dir=tmp_path)
    committer = SnapshotCommitter(run, Reporter(run, None))
    assert not committer.keepers  # it never met this keeper
    assert committer.drop_job() >= 1024
    assert not ray.get(keeper.holdings.remote("gone-job"))["shards"]
    assert ray.get(keeper.holdings.remote("other-job"))["shards"] == [(0, 1, 0, 1)]
    ray.get(keeper.drop_job.remote("other-job"))
