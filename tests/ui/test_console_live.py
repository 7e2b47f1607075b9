"""The job page is live through Server-Sent Events, not polling, in Debian's chromium against a real
store-only server: while a job runs, rows and log lines written to the store the way a supervisor
writes them (JobStore.add_metrics / add_logs) appear on the page (the loss curve grows, the log tail
shows the newest line), over one GET each of …/metrics?follow=true and …/logs?follow=true&tail=N,
never re-requested; the log tail's first load is the newest N lines, not the log from its start; the
streams end when the job does."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from api.app import create_app
from api.server import BackgroundServer
from service.spec import parse_spec
from service.store import JobStore
from tests.ui.conftest import Recorder, login, openapi_of, undocumented

OLD_LINES = 1000  # stored before the page opens: more than the page's tail of 400
STEPS = 16


@dataclass
class Live:
    url: str
    store: JobStore
    token: str
    job_id: str


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    store = JobStore(f"sqlite:///{tmp_path_factory.mktemp('live') / 'jobs.db'}")
    job, _ = store.create_job(parse_spec({"name": "live", "training": {"steps": STEPS}}), "alice",
                              min_world=1, max_world=1)
    store.set_status(job.id, "RUNNING")
    store.add_logs(job.id, [(time.time(), "rank 0", f"old line {i}") for i in range(OLD_LINES)])
    store.add_metrics(job.id, [_row(1), _row(2)])
    srv = BackgroundServer(create_app(store, None, cluster_total={"CPU": 4.0})).start()
    try:
        yield Live(srv.url, store, store.create_token("alice"), job.id)
    finally:
        srv.stop()
        store.close()


def _row(step: int) -> dict[str, Any]:
    return {"step": step, "loss": 4.0 - step / 10, "dp": 1, "generation": 0, "tokens_per_s": 900.0, "step_time_s": 0.2}


def points(page: Any) -> int:
    return int(page.locator("#loss-chart").get_attribute("data-points") or 0)


def test_job_page_follows_streams_without_polling(browser: Any, live: Live) -> None:
    from playwright.sync_api import expect

    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    page = ctx.new_page()
    rec = Recorder(live.url)
    rec.attach(page)
    urls: list[str] = []  # the full address of each request the page's scripts make
    page.on("request", lambda r: urls.append(r.url) if r.resource_type in ("fetch", "xhr", "eventsource") else None)
    login(page, live.url, live.token, next_path=f"/ui/jobs/{live.job_id}")
    expect(page.locator("#live")).to_be_visible(timeout=15_000)
    expect(page.locator("#loss-chart")).to_have_attribute("data-points", "2", timeout=15_000)
    # The tail's first load: the newest 400 of the 1000 stored lines, not the log from its start.
    expect(page.locator("#logs")).to_contain_text(f"old line {OLD_LINES - 1}")
    shown = page.locator("#logs").inner_text().splitlines()
    assert shown[0] == f"old line {OLD_LINES - 400}" and len(shown) == 400

    def writer() -> None:
        for step in range(3, STEPS + 1):
            time.sleep(0.25)
            live.store.add_metrics(live.job_id, [_row(step)])
            live.store.add_logs(live.job_id, [(time.time(), "rank 0", f"step {step} done")])

    t = threading.Thread(target=writer)
    t.start()
    grew = [points(page)]
    try:
        while t.is_alive():
            page.wait_for_timeout(300)
            grew.append(points(page))
    finally:
        t.join()
    expect(page.locator("#loss-chart")).to_have_attribute("data-points", str(STEPS), timeout=10_000)
    expect(page.locator("#logs")).to_contain_text(f"step {STEPS} done")
    # The curve grew while the rows were written, not all at once at the end.
    assert len({g for g in grew if 2 < g < STEPS}) >= 3, grew

    # The job ends: its streams end (the page drops its live mark), and its final rows still arrive.
    live.store.set_status(live.job_id, "SUCCEEDED")
    live.store.add_metrics(live.job_id, [_row(STEPS + 1)])
    expect(page.locator("#live")).to_be_hidden(timeout=10_000)
    expect(page.locator("#job-status")).to_have_text("SUCCEEDED", timeout=10_000)
    expect(page.locator("#loss-chart")).to_have_attribute("data-points", str(STEPS + 1), timeout=10_000)
    page.wait_for_timeout(3000)  # long enough that a poll (the old page read every 1.5 s) would show

    def gets(suffix: str) -> list[dict[str, list[str]]]:
        return [parse_qs(urlsplit(u).query) for u in urls if urlsplit(u).path == f"/v1/jobs/{live.job_id}/{suffix}"]

    metrics, logs = gets("metrics"), gets("logs")
    assert len(metrics) == 1 and metrics[0]["follow"] == ["true"], metrics
    assert len(logs) == 1 and logs[0]["follow"] == ["true"] and logs[0]["tail"] == ["400"], logs
    assert not undocumented(rec.calls, openapi_of(live.url)), undocumented(rec.calls, openapi_of(live.url))
    assert not rec.errors, rec.errors
    ctx.close()
