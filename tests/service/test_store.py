"""The job store on SQLite and PostgreSQL: lifecycle rules, the supervisor's writes, reads, tokens,
and that the Alembic revisions create exactly the tables the models declare."""

from __future__ import annotations

import threading

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from service.models import Base
from service.spec import parse_spec
from service.store import (
    IdempotencyConflictError,
    JobNotFoundError,
    JobNotTerminalError,
    JobStore,
    decode_cursor,
)


def _spec(**kw: object):  # noqa: ANN202
    return parse_spec({"name": "t", **kw})


def _new(store: JobStore, owner: str = "alice", **kw: object):  # noqa: ANN202
    job, created = store.create_job(_spec(**kw), owner, min_world=1, max_world=2)
    assert created
    return job


def test_migrations_match_models_and_reopen(job_store: JobStore) -> None:
    with job_store.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == [], f"models and migrations differ: {diff}"
    again = JobStore(job_store.url)  # already at head: a no-op
    assert again.get_job("missing") is None
    again.close()


def test_status_moves_and_terminal_is_final(job_store: JobStore) -> None:
    j = _new(job_store)
    assert j.status == "PENDING" and j.started_at is None
    job_store.set_status(j.id, "RUNNING")
    job_store.set_status(j.id, "RECOVERING", "worker 2 died")
    job_store.set_status(j.id, "RUNNING")
    job_store.set_status(j.id, "RECOVERING", "node lost")
    job_store.set_status(j.id, "RUNNING")
    job_store.set_status(j.id, "SUCCEEDED")
    job_store.set_status(j.id, "FAILED", "a late write from an old generation")
    job_store.set_status(j.id, "RUNNING")
    got = job_store.get_job(j.id)
    assert got is not None
    assert got.status == "SUCCEEDED" and got.reason is None
    assert got.recoveries == 2
    assert got.started_at is not None and got.finished_at is not None
    kinds = [(e.kind, e.data["status"] if e.kind == "status" else None) for e in job_store.events(j.id)]
    assert kinds == [("submitted", None), ("status", "RUNNING"), ("status", "RECOVERING"), ("status", "RUNNING"),
                     ("status", "RECOVERING"), ("status", "RUNNING"), ("status", "SUCCEEDED")]
    with pytest.raises(ValueError, match="not one of"):
        job_store.set_status(j.id, "DONE")


def test_supervisor_writes_and_reads(job_store: JobStore) -> None:
    j = _new(job_store)
    job_store.add_metrics(j.id, [
        {"step": 1, "loss": 5.5, "dp": 4, "world_size": 4, "generation": 0, "tokens_per_s": 1000.0},
        {"step": 2, "loss": float("nan"), "dp": 3, "world_size": 3, "generation": 1, "tokens_per_s": 900.0},
    ])
    job_store.add_metrics(j.id, [{"step": 1, "loss": 9.9}])  # an older step must not rewind progress
    got = job_store.get_job(j.id)
    assert got is not None and got.progress is not None
    assert got.progress["step"] == 2 and got.progress["dp"] == 3 and got.progress["loss"] is None
    assert [r["step"] for r in job_store.metrics(j.id)] == [1, 1, 2]
    assert [r["step"] for r in job_store.metrics(j.id, after_step=1)] == [2]
    with pytest.raises(ValueError, match="integer 'step'"):
        job_store.add_metrics(j.id, [{"loss": 1.0}])

    job_store.add_checkpoint(j.id, 10, "file:///tmp/ck/10", "persistent", {"bytes": 123})
    job_store.add_checkpoint(j.id, 5, "mem://5", "memory")
    assert [(c.step, c.tier) for c in job_store.checkpoints(j.id)] == [(5, "memory"), (10, "persistent")]

    job_store.add_log(j.id, [f"line {i}" for i in range(5)])
    lines = job_store.logs(j.id)
    assert [x.line for x in lines] == [f"line {i}" for i in range(5)]
    assert [x.line for x in job_store.logs(j.id, after_id=lines[2].id)] == ["line 3", "line 4"]

    job_store.add_event(j.id, "resized", "dp 4 -> 3", {"from": 4, "to": 3})
    assert job_store.events(j.id)[-1].data == {"from": 4, "to": 3}

    # Writes for a job that does not exist are dropped, not raised: a supervisor outliving its job.
    for write in (lambda: job_store.add_event("nope", "x", "y"), lambda: job_store.set_status("nope", "FAILED"),
                  lambda: job_store.add_metrics("nope", [{"step": 1}]), lambda: job_store.add_log("nope", ["x"]),
                  lambda: job_store.add_checkpoint("nope", 1, "file:///x", "persistent")):
        write()
    assert job_store.events("nope") == []


def test_secrets_stored_for_the_runtime_but_masked_for_readers(job_store: JobStore) -> None:
    j = _new(job_store, runtime_env={"secret_env_vars": {"HF_TOKEN": "hf_supersecret"}},
             checkpoint={"s3": {"access_key_id": "AKIA", "secret_access_key": "s3cr3t"}})
    assert "hf_supersecret" not in str(j.spec) and "s3cr3t" not in str(j.spec)
    full = job_store.get_spec(j.id)
    assert full.runtime_env.secret_env_vars["HF_TOKEN"].get_secret_value() == "hf_supersecret"
    assert full.checkpoint.s3.secret_access_key.get_secret_value() == "s3cr3t"
    with pytest.raises(JobNotFoundError):
        job_store.get_spec("missing")


def test_idempotency_key(job_store: JobStore) -> None:
    spec = _spec(priority=3)
    a, created_a = job_store.create_job(spec, "alice", min_world=1, max_world=1, idempotency_key="k1")
    b, created_b = job_store.create_job(spec, "alice", min_world=1, max_world=1, idempotency_key="k1")
    assert created_a and not created_b and a.id == b.id
    c, created_c = job_store.create_job(spec, "bob", min_world=1, max_world=1, idempotency_key="k1")
    assert created_c and c.id != a.id  # keys are per owner
    with pytest.raises(IdempotencyConflictError, match="different spec"):
        job_store.create_job(_spec(priority=4), "alice", min_world=1, max_world=1, idempotency_key="k1")


def test_idempotency_key_under_concurrency(job_store: JobStore) -> None:
    spec = _spec()
    ids: list[str] = []
    barrier = threading.Barrier(6)

    def go() -> None:
        barrier.wait()
        job, _ = job_store.create_job(spec, "carol", min_world=1, max_world=1, idempotency_key="race")
        ids.append(job.id)

    threads = [threading.Thread(target=go) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ids) == 6 and len(set(ids)) == 1
    assert len(job_store.list_jobs(owner="carol")[0]) == 1


def test_list_filters_and_cursor_pages(job_store: JobStore) -> None:
    made = [_new(job_store, owner="dave", name=f"n{i % 2}").id for i in range(7)]
    _new(job_store, owner="erin")
    job_store.set_status(made[0], "RUNNING")
    seen: list[str] = []
    cursor = None
    while True:
        page, cursor = job_store.list_jobs(owner="dave", limit=3, cursor=cursor)
        seen += [j.id for j in page]
        if cursor is None:
            break
    assert seen == made[::-1]  # newest first, each once
    assert [j.id for j in job_store.list_jobs(owner="dave", status=["RUNNING"])[0]] == [made[0]]
    assert {j.id for j in job_store.list_jobs(owner="dave", name="n1")[0]} == set(made[1::2])
    with pytest.raises(ValueError, match="cursor"):
        job_store.list_jobs(cursor="garbage!")
    with pytest.raises(ValueError):
        decode_cursor("czEyM2E")


def test_delete_only_finished_and_everything_goes(job_store: JobStore) -> None:
    j = _new(job_store)
    job_store.add_log(j.id, ["x"])
    with pytest.raises(JobNotTerminalError, match="cancel it"):
        job_store.delete_job(j.id)
    job_store.request_cancel(j.id)
    job_store.set_status(j.id, "CANCELLED", "by test")
    job_store.delete_job(j.id)
    assert job_store.get_job(j.id) is None and job_store.logs(j.id) == [] and job_store.events(j.id) == []
    with pytest.raises(JobNotFoundError):
        job_store.delete_job(j.id)


def test_scheduler_views(job_store: JobStore) -> None:
    low = job_store.create_job(_spec(priority=0), "f", min_world=1, max_world=1)[0]
    high = job_store.create_job(_spec(priority=5), "f", min_world=1, max_world=1)[0]
    low2 = job_store.create_job(_spec(priority=0), "f", min_world=1, max_world=1)[0]
    assert [j.id for j in job_store.queued_jobs()] == [high.id, low.id, low2.id]
    assert job_store.mark_admitted(high.id) and not job_store.mark_admitted(high.id)
    job_store.request_cancel(low.id)
    assert not job_store.mark_admitted(low.id)  # a cancel wins over admission
    assert [j.id for j in job_store.admitted_jobs()] == [high.id]
    assert job_store.queue_length() == 2
    counts = job_store.count_by_status()
    assert counts["PENDING"] == 3 and counts["SUCCEEDED"] == 0


def test_tokens(job_store: JobStore) -> None:
    t = job_store.create_token("gina", "user")
    assert job_store.principal_for_token(t).name == "gina"  # type: ignore[union-attr]
    assert job_store.principal_for_token(t + "x") is None
    a = job_store.create_token("root", "admin")
    assert job_store.principal_for_token(a).is_admin  # type: ignore[union-attr]
    assert job_store.revoke_tokens("gina") == 1 and job_store.principal_for_token(t) is None
    with pytest.raises(ValueError, match="role"):
        job_store.create_token("x", "superuser")
