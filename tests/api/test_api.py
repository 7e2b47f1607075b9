"""The REST API through a real server and the SDK, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.app import create_app
from api.client import Client
from api.errors import Conflict, Forbidden, JobNotFound, Unauthorized, ValidationFailed
from api.server import BackgroundServer
from service.spec import JobSpec
from service.store import JobStore
from tests.api.conftest import Api

TINY = {"name": "tiny", "model": {"preset": "tiny"}, "training": {"steps": 3}}


def _http(api: Api, token: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=api.url, headers=headers, timeout=30)


def test_submit_three_ways_get_and_list(api: Api, tmp_path: Path) -> None:
    name, token = api.user()
    yaml_file = tmp_path / "job.yaml"
    yaml_file.write_text("name: from-yaml\nmodel: {preset: tiny}\nresources: {dp: {min: 2, max: 4}}\n")
    with Client(api.url, token) as c:
        a = c.submit(TINY)
        b = c.submit(JobSpec.model_validate({**TINY, "name": "from-spec", "priority": 7}))
        y = c.submit(str(yaml_file))
        assert (a.status, a.owner, a.name) == ("PENDING", name, "tiny")
        assert (b.priority, b.name) == (7, "from-spec")
        assert (y.min_world, y.max_world) == (2, 4)
        got = c.get(a.id)
        assert got.spec is not None and got.spec["training"]["steps"] == 3 and got.progress.total_steps == 3
        page = c.list()
        assert [j.id for j in page.items] == [y.id, b.id, a.id] and page.next_cursor is None
        assert all(j.spec is None for j in page.items)  # lists stay light


def test_secrets_are_never_returned(api: Api) -> None:
    _, token = api.user()
    body = {**TINY, "runtime_env": {"secret_env_vars": {"HF_TOKEN": "hf_topsecret"}},
            "checkpoint": {"uri": "s3://b/p", "s3": {"access_key_id": "AKIAXX", "secret_access_key": "sk_topsecret"}}}
    with _http(api, token) as h:
        r = h.post("/v1/jobs", json=body)
        assert r.status_code == 201
        job_id = r.json()["id"]
        texts = [r.text, h.get(f"/v1/jobs/{job_id}").text, h.get("/v1/jobs").text,
                 h.get(f"/v1/jobs/{job_id}/events").text]
    for t in texts:
        assert "topsecret" not in t and "AKIAXX" not in t
    assert api.store.get_spec(job_id).runtime_env.secret_env_vars["HF_TOKEN"].get_secret_value() == "hf_topsecret"
    # The SDK sends a JobSpec's secret values (not their masks) to the server.
    with Client(api.url, token) as c:
        sent = c.submit(JobSpec.model_validate(body))
        assert "topsecret" not in sent.model_dump_json()
    assert api.store.get_spec(sent.id).checkpoint.s3.secret_access_key.get_secret_value() == "sk_topsecret"


def _endpoints(job_id: str) -> list[tuple[str, str, Any]]:
    return [
        ("POST", "/v1/jobs", TINY), ("GET", "/v1/jobs", None), ("GET", f"/v1/jobs/{job_id}", None),
        ("POST", f"/v1/jobs/{job_id}/cancel", None), ("DELETE", f"/v1/jobs/{job_id}", None),
        ("GET", f"/v1/jobs/{job_id}/events", None), ("GET", f"/v1/jobs/{job_id}/events?follow=true", None),
        ("GET", f"/v1/jobs/{job_id}/metrics", None), ("GET", f"/v1/jobs/{job_id}/logs", None),
        ("GET", f"/v1/jobs/{job_id}/checkpoints", None), ("GET", f"/v1/jobs/{job_id}/goodput", None),
    ]


def test_auth_matrix(api: Api) -> None:
    alice, ta = api.user("alice")
    bob, tb = api.user("bob")
    with Client(api.url, ta) as ca:
        job = ca.submit(TINY)
    # Every /v1 endpoint refuses a missing or an unknown token with 401 and says why.
    for token, expect in ((None, "missing bearer token"), ("ubk_not-a-real-token", "not valid")):
        with _http(api, token) as h:
            for method, path, body in _endpoints(job.id):
                r = h.request(method, path, json=body)
                assert r.status_code == 401, (method, path, r.status_code)
                assert expect in r.json()["message"] and r.headers["www-authenticate"] == "Bearer"
    with _http(api, None) as h:
        assert h.get("/v1/jobs", headers={"Authorization": "Basic abc"}).status_code == 401
    with Client(api.url, "ubk_wrong") as bad, pytest.raises(Unauthorized, match="not valid"):
        bad.get(job.id)
    # Bob can neither see nor touch Alice's job: it does not exist for him.
    with Client(api.url, tb) as cb:
        for call in (lambda: cb.get(job.id), lambda: cb.cancel(job.id), lambda: cb.delete(job.id),
                     lambda: list(cb.logs(job.id)), lambda: list(cb.logs(job.id, follow=True)),
                     lambda: cb.metrics(job.id), lambda: cb.checkpoints(job.id), lambda: cb.goodput(job.id),
                     lambda: list(cb.events(job.id, follow=False)), lambda: list(cb.events(job.id, follow=True))):
            with pytest.raises(JobNotFound, match=bob):
                call()
        assert cb.list().items == []
        with pytest.raises(Forbidden, match="only its own jobs"):
            cb.list(owner=alice)
        mine = cb.submit(TINY)
    assert api.store.get_job(job.id).status == "PENDING"  # type: ignore[union-attr]
    # An admin sees and filters everyone's jobs.
    with Client(api.url, api.admin_token) as admin:
        assert admin.get(job.id).owner == alice
        assert [j.id for j in admin.list(owner=bob).items] == [mine.id]
        assert {job.id, mine.id} <= {j.id for j in admin.iter_jobs(limit=100)}
        assert admin.cancel(mine.id).status == "CANCELLED"
    with Client(api.url, ta) as ca, pytest.raises(Forbidden):
        ca.list(owner=bob)


BAD_INPUTS: list[tuple[str, Any, str, list[str]]] = [
    # (case, body, content type, fields that must be named)
    ("malformed json", b'{"name": "x",', "application/json", ["body"]),
    ("malformed yaml", b"name: [unclosed\nmodel: {", "application/yaml", ["body"]),
    ("not a mapping", b"[1, 2]", "application/json", ["body"]),
    ("empty body", b"", "application/json", ["body"]),
    ("unknown sections", {"nmae": "x", "model": {"dimm": 3}}, "application/json", ["nmae", "model.dimm"]),
    ("wrong types", {"training": {"steps": "many", "lr": -1}, "priority": 500}, "application/json",
     ["training.steps", "training.lr", "priority"]),
    ("bad name and uri", {"name": "no spaces allowed", "checkpoint": {"uri": "ftp://x"}}, "application/json",
     ["name", "checkpoint.uri"]),
    ("dp range upside down", {"resources": {"dp": {"min": 4, "max": 2}}}, "application/json", ["resources.dp"]),
    ("model not consistent", {"model": {"dim": 64, "n_heads": 5}}, "application/json", ["model"]),
    ("tp does not divide heads", {"parallelism": {"tp": 3}}, "application/json", ["parallelism.tp"]),
    ("cp and tp vs kv heads", {"parallelism": {"tp": 2, "cp": 3}, "model": {"n_kv_heads": 1}}, "application/yaml",
     ["parallelism.tp", "parallelism.cp"]),
    ("world over the cluster", {"resources": {"dp": {"min": 9}}}, "application/json",
     ["resources.cpus_per_worker"]),
    ("gpus the cluster lacks", "resources: {gpus_per_worker: 1}\n", "application/yaml",
     ["resources.gpus_per_worker"]),
    ("dp over the layout", {"parallelism": {"dp_shard": 2}, "resources": {"dp": {"max": 4}}}, "application/json",
     ["resources.dp.max"]),
    ("pip packages nothing installs", "runtime_env: {pip: [einops]}\n", "application/yaml", ["runtime_env.pip"]),
]


@pytest.mark.parametrize(("case", "body", "ctype", "fields"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_422_naming_every_field_and_stores_nothing(
    api: Api, case: str, body: Any, ctype: str, fields: list[str]
) -> None:
    name, token = api.user()
    if isinstance(body, dict):
        raw = json.dumps(body).encode() if ctype == "application/json" else json.dumps(body).encode()
    else:
        raw = body.encode() if isinstance(body, str) else body
    with _http(api, token) as h:
        r = h.post("/v1/jobs", content=raw, headers={"Content-Type": ctype})
        assert r.status_code == 422, (case, r.status_code, r.text)
        err = r.json()
        named = {f["field"] for f in err["fields"]}
        assert set(fields) <= named, (case, err)
        assert err["error"] == "validation_failed" and all(f["message"] for f in err["fields"])
    assert api.store.list_jobs(owner=name)[0] == []


def test_sdk_raises_validation_failed_with_fields(api: Api) -> None:
    _, token = api.user()
    with Client(api.url, token) as c:
        with pytest.raises(ValidationFailed) as e:
            c.submit({"parallelism": {"tp": 3}, "training": {"steps": 0}})
        assert "training.steps" in e.value.fields
        with pytest.raises(ValidationFailed, match="does not exist"):
            c.submit("/no/such/job.yaml")


def test_other_refusals(api: Api) -> None:
    name, token = api.user()
    with _http(api, token) as h:
        big = json.dumps({**TINY, "runtime_env": {"env_vars": {"PAD": "x" * (70 * 1024)}}})
        r = h.post("/v1/jobs", content=big, headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["fields"][0]["field"] == "body"

        def chunks() -> Any:  # no Content-Length: the limit is enforced while reading
            for _ in range(80):
                yield b" " * 1024

        r = h.post("/v1/jobs", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413
        r = h.post("/v1/jobs", content=b"name: x", headers={"Content-Type": "text/plain"})
        assert r.status_code == 415 and "application/yaml" in r.json()["message"]
        r = h.get("/v1/jobs", params={"limit": 0, "status": "DONE"})
        assert r.status_code == 422
        r = h.get("/v1/jobs", params={"status": "DONE"})
        assert r.status_code == 422 and r.json()["fields"][0]["field"] == "status"
        r = h.get("/v1/jobs", params={"cursor": "bogus"})
        assert r.status_code == 422 and r.json()["fields"][0]["field"] == "cursor"
        r = h.get("/v1/nothing-here")
        assert r.status_code == 404 and r.json()["error"] == "not_found"
    assert api.store.list_jobs(owner=name)[0] == []


def test_idempotency_key(api: Api) -> None:
    _, token = api.user()
    _, other = api.user()
    with _http(api, token) as h:
        r1 = h.post("/v1/jobs", json=TINY, headers={"Idempotency-Key": "abc-1"})
        r2 = h.post("/v1/jobs", json=TINY, headers={"Idempotency-Key": "abc-1"})
        assert (r1.status_code, r2.status_code) == (201, 200)
        assert r1.json()["id"] == r2.json()["id"] and r2.headers["idempotent-replayed"] == "true"
        r3 = h.post("/v1/jobs", json={**TINY, "priority": 1}, headers={"Idempotency-Key": "abc-1"})
        assert r3.status_code == 409 and r3.json()["fields"][0]["field"] == "Idempotency-Key"
    with Client(api.url, token) as c:
        assert c.submit(TINY, idempotency_key="abc-1").id == r1.json()["id"]
        with pytest.raises(Conflict, match="different spec"):
            c.submit({**TINY, "name": "other"}, idempotency_key="abc-1")
        assert len(c.list().items) == 1
    with Client(api.url, other) as c:
        assert c.submit(TINY, idempotency_key="abc-1").id != r1.json()["id"]


def test_pagination_and_filters(api: Api) -> None:
    _, token = api.user()
    with Client(api.url, token) as c:
        ids = [c.submit({**TINY, "name": f"p{i % 3}"}).id for i in range(8)]
        c.cancel(ids[2])
        pages, cursor = [], None
        while True:
            page = c.list(limit=3, cursor=cursor)
            pages.append([j.id for j in page.items])
            cursor = page.next_cursor
            if cursor is None:
                break
        assert [len(p) for p in pages] == [3, 3, 2]
        assert [i for p in pages for i in p] == ids[::-1]
        assert [j.id for j in c.list(status="CANCELLED").items] == [ids[2]]
        assert [j.id for j in c.list(status=["PENDING", "CANCELLED"], name="p2").items] == [ids[5], ids[2]]
        assert [j.id for j in c.iter_jobs(limit=2, name="p0")] == [ids[6], ids[3], ids[0]]


def test_cancel_and_delete(api: Api) -> None:
    _, token = api.user()
    with Client(api.url, token) as c:
        j = c.submit(TINY)
        with pytest.raises(Conflict, match="cancel it"):
            c.delete(j.id)
        done = c.cancel(j.id)
        assert done.status == "CANCELLED" and done.cancel_requested and done.finished_at is not None
        assert c.cancel(j.id).status == "CANCELLED"  # cancelling twice is fine
        kinds = [e.kind for e in c.events(j.id, follow=False)]
        assert kinds == ["submitted", "cancel_requested", "status"]
        c.delete(j.id)
        with pytest.raises(JobNotFound):
            c.get(j.id)
        k = c.submit(TINY)
    api.store.set_status(k.id, "SUCCEEDED")
    with Client(api.url, token) as c, pytest.raises(Conflict, match="already finished"):
        c.cancel(k.id)


def test_runtime_reports_reach_the_sdk_and_events_stream_until_the_end(api: Api) -> None:
    """The supervisor's write path (JobStore) seen through the API: progress, metrics, logs,
    checkpoints, and an SSE stream that ends when the job reaches a terminal status."""
    _, token = api.user()
    with Client(api.url, token) as c:
        j = c.submit(TINY)
    seen: list[str] = []

    def follow() -> None:
        with Client(api.url, token) as c2:
            seen.extend(f"{e.kind}:{e.message}" for e in c2.events(j.id, follow=True))

    t = threading.Thread(target=follow)
    t.start()
    s = api.store
    s.set_status(j.id, "RUNNING")
    s.add_metrics(j.id, [{"step": 1, "loss": 5.0, "dp": 2, "world_size": 2, "generation": 0, "tokens_per_s": 512.0}])
    s.add_log(j.id, ["rank0: step 1 loss 5.0"])
    s.set_status(j.id, "RECOVERING", "worker 1 died")
    s.add_event(j.id, "resized", "dp 2 -> 1", {"from": 2, "to": 1})
    s.set_status(j.id, "RUNNING")
    s.add_metrics(j.id, [{"step": 2, "loss": 4.5, "dp": 1, "world_size": 1, "generation": 1, "tokens_per_s": 300.0},
                         {"step": 3, "loss": 4.0, "dp": 1, "world_size": 1, "generation": 1, "tokens_per_s": 310.0}])
    s.add_checkpoint(j.id, 3, "file:///tmp/ck/step-3", "persistent", {"bytes": 1000})
    s.add_log(j.id, ["rank0: step 3 loss 4.0", "done"])
    time.sleep(0.3)
    s.set_status(j.id, "SUCCEEDED")
    t.join(30)
    assert not t.is_alive(), "the event stream did not end with the job"
    assert seen == ["submitted:submitted by " + j.owner, "status:RUNNING", "status:RECOVERING: worker 1 died",
                    "resized:dp 2 -> 1", "status:RUNNING", "status:SUCCEEDED"]
    with Client(api.url, token) as c:
        job = c.get(j.id)
        assert (job.status, job.progress.step, job.progress.loss, job.progress.dp, job.progress.recoveries) == (
            "SUCCEEDED", 3, 4.0, 1, 1)
        assert [m["step"] for m in c.metrics(j.id)] == [1, 2, 3]
        assert [m["step"] for m in c.metrics(j.id, after_step=2)] == [3]
        logs = list(c.logs(j.id))
        assert [x.line for x in logs] == ["rank0: step 1 loss 5.0", "rank0: step 3 loss 4.0", "done"]
        assert list(c.logs(j.id, after=logs[-1].id)) == []
        assert [(k.step, k.tier, k.uri) for k in c.checkpoints(j.id)] == [(3, "persistent", "file:///tmp/ck/step-3")]
        # Resuming the stream after an event id returns only what came later, and ends at once.
        tail = list(c.events(j.id, follow=True, after=max(e.id for e in c.events(j.id, follow=False)) - 1))
        assert [e.kind for e in tail] == ["status"]
        assert c.wait(j.id, timeout=5).status == "SUCCEEDED"


def test_wait_times_out_and_reports_progress(api: Api) -> None:
    _, token = api.user()
    calls: list[str] = []
    with Client(api.url, token) as c:
        j = c.submit(TINY)
        with pytest.raises(TimeoutError, match="still PENDING"):
            c.wait(j.id, timeout=0.3, progress_callback=lambda job: calls.append(job.status), poll_s=0.1)
    assert calls and set(calls) == {"PENDING"}


def test_health_readiness_metrics_and_docs(api: Api) -> None:
    with _http(api, None) as h:
        assert h.get("/healthz").json()["status"] == "ok"
        ready = h.get("/readyz")
        assert ready.status_code == 200 and ready.json()["detail"]["scheduler"] is False
        h.get("/v1/jobs")  # one 401, counted
        text = h.get("/metrics").text
        assert 'unbroken_api_requests_total{method="GET",route="/v1/jobs",status="401"}' in text
        assert "unbroken_api_request_seconds_bucket" in text
        assert 'unbroken_jobs{status="PENDING"}' in text and "unbroken_queue_length" in text
        spec = h.get("/openapi.json").json()
        body = spec["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]
        assert set(body) == {"application/json", "application/yaml"} and "JobSpec" in spec["components"]["schemas"]
        assert h.get("/docs").status_code == 200


def test_restart_keeps_jobs(api: Api) -> None:
    """A second server process-equivalent (new store, new app, new port) over the same database."""
    _, token = api.user()
    with Client(api.url, token) as c:
        ids = [c.submit(TINY).id for _ in range(3)]
        c.cancel(ids[0])
    store = JobStore(api.db_url)
    try:
        with BackgroundServer(create_app(store, None)) as again, Client(again.url, token) as c:
            assert [j.id for j in c.list().items] == ids[::-1]
            assert c.get(ids[0]).status == "CANCELLED" and c.get(ids[1]).status == "PENDING"
    finally:
        store.close()


@pytest.mark.parametrize("outcome", ["SUCCEEDED", "FAILED"])
def test_cli_submit_wait_follows_progress_to_the_end(api: Api, tmp_path: Path, outcome: str) -> None:
    from typer.testing import CliRunner

    from api.cli import app

    name, token = api.user()
    job_file = tmp_path / "job.yaml"
    job_file.write_text("name: waited\nmodel: {preset: tiny}\ntraining: {steps: 4}\n")

    def runtime() -> None:  # the supervisor's reports, through the store as it writes them
        jobs = until_jobs(api.store, name)
        jid = jobs[0].id
        api.store.set_status(jid, "RUNNING")
        for step in range(1, 5):
            api.store.add_metrics(jid, [{"step": step, "loss": 5.0 - step, "dp": 2, "tokens_per_s": 1000.0}])
            time.sleep(0.3)
        api.store.set_status(jid, outcome, None if outcome == "SUCCEEDED" else "worker exploded")

    t = threading.Thread(target=runtime)
    t.start()
    r = CliRunner().invoke(app, ["submit", str(job_file), "--wait"],
                           env={"UNBROKEN_URL": api.url, "UNBROKEN_TOKEN": token})
    t.join(30)
    assert r.exit_code == (0 if outcome == "SUCCEEDED" else 1), r.output
    assert outcome in r.output and "4/4" in r.output
    if outcome == "FAILED":
        assert "worker exploded" in r.output


def test_goodput_through_the_sdk_rest_and_the_cli(api: Api) -> None:
    """A job's goodput (service.goodput) from the rows and pause events the supervisor stores."""
    from typer.testing import CliRunner

    from api.cli import app

    _, token = api.user()
    with Client(api.url, token) as c:
        j = c.submit(TINY)
        empty = c.goodput(j.id)
        assert (empty.steps, empty.ratio, empty.pauses) == (0, None, 0)
        s = api.store
        s.set_status(j.id, "RUNNING")
        # steps of 0.5 s from t=1000; a recovery paused 1.5 s before step 3, a grow 0.5 s before step 5
        ends = [1000.5, 1001.0, 1003.0, 1003.5, 1004.5]
        s.add_metrics(j.id, [{"step": i + 1, "loss": 5.0, "dp": 2, "generation": 0, "end_time": t, "step_time_s": 0.5}
                             for i, t in enumerate(ends)])  # fmt: skip
        s.add_event(j.id, "recovered", "Recovered ...", {"kind": "worker_died", "pause_s": 1.5, "lost_steps": 1})
        s.add_event(j.id, "resumed", "Training resumed ...", {"cause": "growth", "pause_s": 0.5})
        g = c.goodput(j.id)
    assert (g.steps, g.pauses, g.lost_steps) == (5, 2, 1)
    assert (g.wall_s, g.step_s, g.paused_s, g.other_s) == pytest.approx((4.5, 2.5, 2.0, 0.0))
    assert g.ratio == pytest.approx(2.5 / 4.5) and g.paused_by_cause == {"worker_died": 1.5, "growth": 0.5}
    with _http(api, token) as h:
        assert h.get(f"/v1/jobs/{j.id}/goodput").json()["ratio"] == pytest.approx(g.ratio)
    line = "0.56 of 4.5s since step 1 in steps; paused 2.0s in 2 re-forms (worker_died 1.5s, growth 0.5s); 1 step trained again"
    assert (empty.summary, g.summary) == ("-", line)
    r = CliRunner().invoke(app, ["status", j.id], env={"UNBROKEN_URL": api.url, "UNBROKEN_TOKEN": token})
    assert r.exit_code == 0, r.output
    assert f"goodput: {line}" in r.output, r.output


def until_jobs(store: JobStore, owner: str, timeout: float = 30.0) -> list[Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        jobs, _ = store.list_jobs(owner=owner)
        if jobs:
            return jobs
        time.sleep(0.05)
    raise AssertionError(f"no job of {owner} appeared")


def test_progress_carries_the_newest_eval_loss(api: Api) -> None:
    """A held-out loss reaches the job's progress (the SDK's JobProgress and the CLI's line) and stays
    until a newer one, though most rows carry none."""
    from api.client import JobProgress

    _, token = api.user()
    with Client(api.url, token) as c:
        j = c.submit(TINY)
        api.store.add_metrics(j.id, [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.8, "eval_loss": 4.9}])
        api.store.add_metrics(j.id, [{"step": 3, "loss": 4.6}])
        job = c.get(j.id)
        assert (job.progress.step, job.progress.eval_loss) == (3, 4.9)
        assert "eval loss 4.9000" in str(JobProgress.of(job))
