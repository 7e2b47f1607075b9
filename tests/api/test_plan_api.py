"""POST /v1/plan and `parallelism: auto` at submission, through real uvicorn servers and the SDK
(SQLite): a store-only server with the CPU view of tests/api/conftest.py, one with a GPU cluster's
Ray resources, one without any cluster view, and one connected to a private Ray cluster."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.app import create_app
from api.client import Client
from api.errors import Unauthorized, ValidationFailed
from api.server import BackgroundServer
from parallel.config import ParallelConfig
from service.spec import JobSpec
from service.store import JobStore
from tests.api.conftest import CLUSTER, Api

TINY: dict[str, Any] = {"name": "tiny", "model": {"preset": "tiny"},
                        "training": {"steps": 2, "seq_len": 32, "global_batch_size": 8}}
GPU_VIEW = {"CPU": 64.0, "GPU": 16.0, "node:10.0.0.1": 1.0, "node:10.0.0.2": 1.0, "accelerator_type:H200": 2.0}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Api]]:
    """Three store-only servers over one SQLite store: the CPU view, a GPU view, no view."""
    url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'unbroken.db'}"
    store = JobStore(url)
    admin = store.create_token("root", "admin")
    out: dict[str, Api] = {}
    try:
        for key, view in (("cpu", CLUSTER), ("gpu", GPU_VIEW), ("none", None)):
            server = BackgroundServer(create_app(store, None, max_body_bytes=64 * 1024, cluster_total=view))
            server.start()
            out[key] = Api(server.url, url, store, admin, server)
        yield out
    finally:
        for a in out.values():
            a.server.stop()
        store.close()


def _events(c: Client, job_id: str) -> list[Any]:
    return list(c.events(job_id, follow=False))


def test_plan_happy_path(servers: dict[str, Api], tmp_path: Path) -> None:
    api = servers["cpu"]
    _, token = api.user()
    with Client(api.url, token) as c:
        # The default cluster: the server's view (8 CPUs at 1 per worker -> 8 cpu ranks).
        got = c.plan({**TINY, "parallelism": "auto"})
        assert got["ok"] and got["cluster"]["gpu"] == "cpu" and got["cluster"]["gpus"] == 8
        assert "8 CPUs" in got["cluster"]["source"]
        best = got["best"]
        assert best["peak_memory_bytes"] <= best["capacity_bytes"] and best["tokens_per_s"] > 0
        sizes = got["parallelism"]
        assert sizes["dp_replicate"] * sizes["dp_shard"] * sizes["cp"] * sizes["tp"] * sizes["pp"] == 8
        assert got["submission"]["ok"] and got["submission"]["cluster"]["gpus"] == 8
        # Explicit cluster, a job.yaml path (sent as YAML), and the job's own layout evaluated.
        job = tmp_path / "job.yaml"
        job.write_text("model: {preset: llama3-8b}\ntraining: {seq_len: 1024, global_batch_size: 16}\n"
                       "parallelism: {dp_shard: 16}\n")
        big = c.plan(str(job), gpus=16, gpu="h100")
        assert big["cluster"] == {**big["cluster"], "gpu": "h100", "gpus": 16, "nodes": 2,
                                  "source": "as requested (gpus, gpu, nodes)"}
        assert big["requested"]["layout"] == "dp_shard=16" and big["requested"]["fits"] is True
        assert "submission" not in big  # not an auto job
        # A job that fits nowhere is still a plan (200), with the reasons.
        none = c.plan(JobSpec.model_validate({"model": {"preset": "llama3-70b"}}), gpus=2, gpu="cpu")
        assert none["ok"] is False and none["best"] is None
        assert none["reasons"] and all("per device" in r for r in none["reasons"])
    # The GPU view: H200s on 2 nodes, for a job asking a GPU per worker.
    with Client(servers["gpu"].url, token) as c:
        gpu = c.plan({**TINY, "resources": {"gpus_per_worker": 1}})
        assert (gpu["cluster"]["gpu"], gpu["cluster"]["gpus"], gpu["cluster"]["nodes"]) == ("h200", 16, 2)
    # Raw YAML over HTTP works the same.
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as h:
        r = h.post("/v1/plan", params={"gpus": 4, "gpu": "cpu"}, content=b"model: {preset: tiny}\n",
                   headers={"Content-Type": "application/yaml"})
        assert r.status_code == 200 and r.json()["cluster"]["gpus"] == 4


def test_plan_refuses_bad_bodies_and_params(servers: dict[str, Api]) -> None:
    api = servers["cpu"]
    _, token = api.user()
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as h:
        def fields(r: httpx.Response) -> dict[str, str]:
            assert r.status_code == 422, r.text
            return {f["field"]: f["message"] for f in r.json()["fields"]}

        bad = fields(h.post("/v1/plan", json={"model": {"preset": "tiny", "n_heads": 3}}))
        assert "model" in bad and "n_heads=3" in bad["model"]
        assert "training.steps" in fields(h.post("/v1/plan", json={**TINY, "training": {"steps": 0}}))
        # Found by fuzzing: a width multiplier near float max overflowed the planner (a 500, not a 422).
        huge = {"model": {"family": "mistral", "ffn_dim_multiplier": 1.12e308, "n_layers": 223218}}
        assert "model.ffn_dim_multiplier" in fields(h.post("/v1/plan", json=huge))
        assert "body" in fields(h.post("/v1/plan", content=b"model: [", headers={"Content-Type": "application/yaml"}))
        assert "body" in fields(h.post("/v1/plan", content=b"", headers={"Content-Type": "application/json"}))
        assert "query.gpu" in fields(h.post("/v1/plan", params={"gpus": 8, "gpu": "tpu"}, json=TINY))
        assert "query.gpus" in fields(h.post("/v1/plan", params={"gpus": 0}, json=TINY))
        uneven = fields(h.post("/v1/plan", params={"gpus": 12, "gpu": "h100", "nodes": 5}, json=TINY))
        assert "divisible by nodes=5" in uneven["nodes"]
        assert h.post("/v1/plan", json=TINY, headers={"Content-Type": "text/plain"}).status_code == 415
    # A store-only server with no cluster view needs the cluster in the query.
    with Client(servers["none"].url, token) as c:
        with pytest.raises(ValidationFailed) as e:
            c.plan(TINY)
        assert "?gpus=N" in e.value.fields["gpus"]
        assert c.plan(TINY, gpus=2, gpu="cpu")["cluster"]["gpus"] == 2


def test_plan_needs_a_valid_token(servers: dict[str, Api]) -> None:
    api = servers["cpu"]
    for token in (None, "not-a-token"):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        r = httpx.post(f"{api.url}/v1/plan", json=TINY, headers=headers, timeout=30)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    with Client(api.url, "not-a-token") as c, pytest.raises(Unauthorized):
        c.plan(TINY)


def test_auto_is_resolved_at_submission(servers: dict[str, Api]) -> None:
    api = servers["cpu"]
    _, token = api.user()
    with Client(api.url, token) as c:
        job = c.submit({**TINY, "parallelism": "auto", "resources": {"dp": {"min": 2}}})
        # The stored spec (what the supervisor reads) has a concrete layout filling the 8 ranks.
        stored = api.store.get_spec(job.id)
        p = stored.parallelism
        assert not p.auto and p.dp_shard >= 1 and job.spec is not None and job.spec["parallelism"]["auto"] is False
        mp = p.tp * p.pp * p.cp
        dp = p.dp_replicate * p.dp_shard
        assert dp * mp == 8 and dp >= 2
        assert (job.min_world, job.max_world) == (2 * mp, dp * mp)
        kinds = [e.kind for e in _events(c, job.id)]
        assert kinds[:2] == ["submitted", "layout_chosen"]
        ev = _events(c, job.id)[1]
        assert ev.data is not None
        assert {k: ev.data["parallelism"][k] for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")} == {
            k: getattr(p, k) for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")}
        assert ev.data["tokens_per_s"] > 0 and 0 < ev.data["peak_memory_bytes"] <= ev.data["capacity_bytes"]
        assert ev.data["cluster"]["gpus"] == 8 and ev.data["layout"] in ev.message
        # A partial auto from an SDK JobSpec: the size it sets stays, the rest is chosen.
        part = c.submit(JobSpec(**{**TINY, "parallelism": ParallelConfig(auto=True, tp=2)}))
        assert api.store.get_spec(part.id).parallelism.tp == 2
        # An idempotent replay stores nothing new and records no second choice.
        key = uuid.uuid4().hex
        first = c.submit({**TINY, "parallelism": "auto"}, idempotency_key=key)
        again = c.submit({**TINY, "parallelism": "auto"}, idempotency_key=key)
        assert again.id == first.id
        assert [e.kind for e in _events(c, first.id)].count("layout_chosen") == 1
    # On the GPU view the choice is made for the cluster's H200s.
    with Client(servers["gpu"].url, token) as c:
        g = c.submit({**TINY, "parallelism": "auto", "resources": {"gpus_per_worker": 1}})
        ev = next(e for e in _events(c, g.id) if e.kind == "layout_chosen")
        assert ev.data is not None and ev.data["cluster"]["gpu"] == "h200" and ev.data["cluster"]["gpus"] == 16


def test_impossible_auto_is_refused_and_not_stored(servers: dict[str, Api]) -> None:
    api = servers["cpu"]
    name, token = api.user()
    with Client(api.url, token) as c:
        with pytest.raises(ValidationFailed) as e:
            c.submit({"name": "too-big", "model": {"preset": "llama3-70b"}, "parallelism": "auto"})
        why = e.value.fields["parallelism"]
        assert why.startswith("no layout fits 8x cpu") and "per device" in why and "usable" in why
        with pytest.raises(ValidationFailed) as e:
            c.submit({**TINY, "name": "too-wide", "parallelism": "auto", "resources": {"dp": {"min": 16}}})
        assert "resources.dp.min=16" in e.value.fields["parallelism"]
        assert c.list(owner=name).items == []
    # Without a cluster view there is nothing to plan for: refused, naming parallelism.
    with Client(servers["none"].url, token) as c:
        with pytest.raises(ValidationFailed) as e:
            c.submit({**TINY, "parallelism": "auto"})
        assert "set the parallel sizes explicitly" in e.value.fields["parallelism"]
        assert c.list(owner=name).items == []


@pytest.fixture(scope="module")
def ray_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    """A server whose scheduler reads a private single-node Ray cluster (the scheduler is not started:
    jobs stay queued, only its view of the cluster is used)."""
    import ray

    from service.scheduler import Scheduler

    ray.init(address="local", num_cpus=4, include_dashboard=False, namespace=f"plan-{uuid.uuid4().hex[:6]}",
             log_to_driver=False)
    url = f"sqlite:///{tmp_path_factory.mktemp('ray-db') / 'unbroken.db'}"
    store = JobStore(url)
    server = BackgroundServer(create_app(store, Scheduler(store)))
    try:
        server.start()
        yield Api(server.url, url, store, store.create_token("root", "admin"), server)
    finally:
        server.stop()
        store.close()
        ray.shutdown()


def test_plan_and_auto_read_the_connected_ray_cluster(ray_api: Api) -> None:
    _, token = ray_api.user()
    with Client(ray_api.url, token) as c:
        got = c.plan({**TINY, "parallelism": "auto"})
        assert (got["cluster"]["gpu"], got["cluster"]["gpus"]) == ("cpu", 4) and "4 CPUs" in got["cluster"]["source"]
        job = c.submit({**TINY, "parallelism": "auto"})
        p = ray_api.store.get_spec(job.id).parallelism
        assert not p.auto and p.dp_replicate * p.dp_shard * p.cp * p.tp * p.pp == 4
        assert "layout_chosen" in [e.kind for e in _events(c, job.id)]
