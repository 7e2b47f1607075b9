"""deploy/grafana/unbroken.json queries only metrics that exist: the runtime's (as declared in
workers/telemetry.py, whose names tests/runtime/test_telemetry.py reads back from Ray's exporter)
and the control plane's (read here from a real app's /metrics), and covers all of them."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from api.app import create_app
from service.store import JobStore
from tests.deploy.validation import REPO
from workers import telemetry

DASHBOARD = REPO / "deploy" / "grafana" / "unbroken.json"
METRIC = re.compile(r"\b((?:ray_)?unbroken_[a-z0-9_]+)\b")


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def all_exprs(d: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in d["annotations"]["list"] if "expr" in a]
    exprs += [v["definition"] for v in d["templating"]["list"] if "definition" in v]
    return exprs


@pytest.fixture(scope="module")
def api_metric_names(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Series names the API serves, after one request so the request counters exist, with one admitted
    job that has reported a step so the per-job series exist."""
    from service.spec import parse_spec

    store = JobStore(f"sqlite:///{tmp_path_factory.mktemp('db') / 'u.db'}")
    try:
        job, _ = store.create_job(parse_spec({"model": {"preset": "tiny"}}), "u", min_world=1, max_world=1)
        assert store.mark_admitted(job.id)
        store.add_metrics(job.id, [{"step": 3, "dp": 1, "loss": 5.0}])
        with TestClient(create_app(store, None)) as c:
            assert c.get("/healthz").status_code == 200
            text = c.get("/metrics").text
    finally:
        store.close()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_dashboard_is_well_formed() -> None:
    d = dashboard()
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 30
    names = {v["name"] for v in d["templating"]["list"]}
    assert {"datasource", "job_id"} <= names
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] != "row":
            assert p["targets"], p["title"]
            assert p["datasource"]["uid"] == "${datasource}"
            for t in p["targets"]:
                assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
                assert t["expr"].count("{") == t["expr"].count("}"), t["expr"]


def test_every_queried_metric_exists(api_metric_names: set[str]) -> None:
    assert telemetry.API_METRICS and set(telemetry.API_METRICS) <= api_metric_names, \
        set(telemetry.API_METRICS) - api_metric_names
    known = telemetry.exported_names() | api_metric_names
    used = {m for e in all_exprs(dashboard()) for m in METRIC.findall(e)}
    unknown = used - known
    assert not unknown, f"the dashboard queries metrics nobody exports: {sorted(unknown)}"


def test_every_metric_is_on_the_dashboard() -> None:
    used = {m for e in all_exprs(dashboard()) for m in METRIC.findall(e)}
    for m in telemetry.METRICS:
        assert set(m.exported) & used, f"{m.name} is exported but not shown"
    for name in ("unbroken_api_requests_total", "unbroken_api_request_seconds_bucket", "unbroken_queue_length",
                 "unbroken_jobs", "unbroken_job_info", "unbroken_job_step", "unbroken_job_dp",
                 "unbroken_job_recoveries"):
        assert name in used


def test_job_panels_follow_the_job_variable() -> None:
    """Every query over a job's metrics filters by the dashboard's job selection."""
    for e in all_exprs(dashboard()):
        for m in METRIC.findall(e):
            md = telemetry.BY_NAME.get(re.sub(r"^ray_|_(bucket|sum|count)$", "", m))
            if md is not None and "job_id" in md.tag_keys and not e.startswith("label_values"):
                assert 'job_id=~"$job_id"' in e, e


def test_a_wrong_name_is_caught(api_metric_names: set[str]) -> None:
    """The check above is not vacuous: a misspelt metric in a copy of the dashboard is found."""
    d = dashboard()
    d["panels"][1]["targets"][0]["expr"] = 'ray_unbroken_losss{job_id=~"$job_id"}'
    used = {m for e in all_exprs(d) for m in METRIC.findall(e)}
    assert "ray_unbroken_losss" in used - (telemetry.exported_names() | api_metric_names)

