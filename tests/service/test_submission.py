"""service.submission: the submit policy without HTTP, on a real SQLite store (store-only: no scheduler;
the API tests cover a running one)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from service.store import IdempotencyConflictError, JobStore
from service.submission import SubmissionRefused, submit

TINY = {"model": {"preset": "tiny"}, "training": {"steps": 2, "seq_len": 32, "global_batch_size": 8}}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[JobStore]:
    s = JobStore(f"sqlite:///{tmp_path / 'jobs.db'}")
    yield s
    s.close()


def test_refusals_name_the_field(store: JobStore) -> None:
    for data, field in [([1, 2], "body"), ({**TINY, "training": {"steps": 0}}, "training.steps"),
                        ({**TINY, "parallelism": {"cp": 2}, "training": {"seq_len": 6}}, "parallelism.cp"),
                        ({**TINY, "parallelism": "auto"}, "parallelism"),
                        ({**TINY, "resources": {"dp": {"min": 9}}}, "resources.cpus_per_worker")]:
        with pytest.raises(SubmissionRefused) as e:
            submit(store, None, data, "alice", cluster_total={"CPU": 8.0} if field != "parallelism" else None)
        assert field in [f for f, _ in e.value.problems], e.value.problems
    assert store.list_jobs(owner=None)[0] == []  # nothing refused was stored


def test_a_job_is_stored_once(store: JobStore) -> None:
    first = submit(store, None, {**TINY, "name": "a"}, "alice", cluster_total={"CPU": 8.0}, idempotency_key="k")
    again = submit(store, None, {**TINY, "name": "a"}, "alice", cluster_total={"CPU": 8.0}, idempotency_key="k")
    assert first.created and not again.created and again.job.id == first.job.id
    assert (first.job.owner, first.job.status, first.job.min_world) == ("alice", "PENDING", 1)
    with pytest.raises(IdempotencyConflictError):
        submit(store, None, {**TINY, "name": "b"}, "alice", cluster_total={"CPU": 8.0}, idempotency_key="k")


def test_auto_records_the_chosen_layout(store: JobStore) -> None:
    done = submit(store, None, {**TINY, "parallelism": "auto"}, "alice", cluster_total={"CPU": 4.0})
    assert not done.job.spec["parallelism"]["auto"]
    assert [e.kind for e in store.events(done.job.id, 0, 100)] == ["submitted", "layout_chosen"]
