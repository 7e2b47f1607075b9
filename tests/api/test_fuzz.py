"""Schemathesis against /openapi.json of a real server: >= 1,000 generated requests (valid and
invalid), authenticated, and not one may get a 5xx answer."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable

from api.app import create_app
from api.server import BackgroundServer
from service.spec import parse_spec
from service.store import JobStore

PER_OPERATION_AND_MODE = 60
MIN_REQUESTS = 1000


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    store = JobStore(f"sqlite:///{tmp_path_factory.mktemp('fuzz') / 'fuzz.db'}")
    token = store.create_token("fuzzer", "user")
    # A finished job of the fuzzing user, so generated requests also reach real rows (and a
    # followed event stream ends instead of waiting on a job that never finishes).
    job, _ = store.create_job(parse_spec({"name": "seed"}), "fuzzer", min_world=1, max_world=1)
    store.add_metrics(job.id, [{"step": 1, "loss": 2.0}])
    store.add_log(job.id, ["hello"])
    store.add_checkpoint(job.id, 1, "file:///tmp/x", "persistent")
    store.set_status(job.id, "SUCCEEDED")
    server = BackgroundServer(create_app(store, None, max_body_bytes=64 * 1024, cluster_total={"CPU": 16.0}))
    server.start()
    try:
        yield server.url, token, job.id
    finally:
        server.stop()
        store.close()


def test_no_server_errors_under_fuzzing(fuzz_server: tuple[str, str, str]) -> None:
    url, token, job_id = fuzz_server
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    session = requests.Session()
    auth = {"Authorization": f"Bearer {token}"}
    sent = 0
    failures: list[str] = []
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            path_params = {"job_id": job_id} if "{job_id}" in op.path and mode.name == "POSITIVE" else None
            strategy = op.as_strategy(generation_mode=mode, path_parameters=path_params)

            @settings(max_examples=PER_OPERATION_AND_MODE, deadline=None, database=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=strategy)
            def run(case: schemathesis.Case) -> None:
                nonlocal sent
                response = case.call(base_url=url, session=session, headers=auth, timeout=30)
                sent += 1
                if response.status_code >= 500:
                    failures.append(f"{case.method} {case.formatted_path} -> {response.status_code}: "
                                    f"{response.text[:300]}\n  {case.as_curl_command()}")

            t0, before = time.perf_counter(), sent
            try:
                run()
            except Unsatisfiable:
                continue  # e.g. no invalid request exists for an operation without inputs
            finally:
                print(f"{op.method.upper():6} {op.path:34} {mode.name:8} {sent - before:3} requests "
                      f"{time.perf_counter() - t0:5.1f} s")
    assert not failures, "\n".join(failures[:10])
    assert sent >= MIN_REQUESTS, f"only {sent} requests were generated"
