"""A job's logs through a real server and store: GET /v1/jobs/{id}/logs (pages, and ?follow=true
streaming until the job ends; ?tail=N the newest N lines), the SDK's logs(follow=...), and `unbroken logs JOB -f`. Lines are
written the way the supervisor writes them, through JobStore.add_logs."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from typer.testing import CliRunner

from api.cli import app
from api.client import Client
from api.routers import jobs
from tests.api.conftest import Api

TINY = {"name": "tiny", "model": {"preset": "tiny"}, "training": {"steps": 3}}


def _writer(api: Api, job_id: str, lines: list[tuple[str, str]], *, then: str = "SUCCEEDED",
            after_end: list[tuple[str, str]] | None = None) -> threading.Thread:
    """Writes the lines a few at a time while the job runs, ends it, then writes `after_end`."""

    def go() -> None:
        s = api.store
        s.set_status(job_id, "RUNNING")
        for i in range(0, len(lines), 2):
            time.sleep(0.15)
            s.add_logs(job_id, [(time.time(), src, text) for src, text in lines[i:i + 2]])
        s.set_status(job_id, then, None if then == "SUCCEEDED" else "boom")
        if after_end:  # the last output, flushed just after the final status
            s.add_logs(job_id, [(time.time(), src, text) for src, text in after_end])

    t = threading.Thread(target=go)
    t.start()
    return t


LINES = [("supervisor", "starting 2 workers"), ("rank 0", "step 1 loss 5.0"), ("rank 1", "step 1 loss 5.0"),
         ("rank 0", "step 2 loss 4.5"), ("rank 1", "Traceback (most recent call last):")]


def test_follow_streams_lines_until_the_job_ends(api: Api) -> None:
    _, token = api.user()
    with Client(api.url, token) as c:
        j = c.submit(TINY)
        assert list(c.logs(j.id)) == []
        t = _writer(api, j.id, LINES, after_end=[("supervisor", "released 2 workers")])
        started = time.monotonic()
        got = [(x.source, x.line) for x in c.logs(j.id, follow=True)]
        t.join()
        assert got == [*LINES, ("supervisor", "released 2 workers")]
        assert time.monotonic() - started < 20
        # Without follow: the same lines, in pages of the route, resumable after an id.
        items = list(c.logs(j.id))
        assert [(x.source, x.line) for x in items] == got and all(x.ts > 0 for x in items)
        assert [x.line for x in c.logs(j.id, after=items[3].id)] == [x.line for x in items[4:]]
        # A follow of a finished job returns what is stored and ends.
        assert [x.line for x in c.logs(j.id, follow=True, after=items[-2].id)] == ["released 2 workers"]


def test_route_pages_and_sse_shape(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    _, token = api.user()
    with Client(api.url, token) as c:
        j = c.submit(TINY)
    api.store.add_logs(j.id, [(1.0 + i, "rank 0", f"line {i}") for i in range(5)])
    api.store.set_status(j.id, "CANCELLED", "by test")
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as h:
        page = h.get(f"/v1/jobs/{j.id}/logs", params={"limit": 2}).json()
        assert [x["line"] for x in page["items"]] == ["line 0", "line 1"]
        assert page["items"][0]["source"] == "rank 0" and page["items"][0]["ts"] == 1.0
        nxt = h.get(f"/v1/jobs/{j.id}/logs", params={"after": page["next_after"]}).json()
        assert [x["line"] for x in nxt["items"]] == ["line 2", "line 3", "line 4"]
        r = h.get(f"/v1/jobs/{j.id}/logs", params={"follow": "true"},
                  headers={"Last-Event-ID": str(nxt["items"][0]["id"])})
        assert r.headers["content-type"].startswith("text/event-stream")
        frames = [f for f in r.text.split("\n\n") if f]
        assert [f.split("\n")[1] for f in frames[:2]] == ["event: log", "event: log"]
        assert frames[2] == "event: end\ndata: {}"
        assert '"line":"line 3"' in frames[0] and frames[0].startswith(f"id: {nxt['items'][1]['id']}\n")
        bad = h.get(f"/v1/jobs/{j.id}/logs", params={"limit": 0})
        assert bad.status_code == 422 and bad.json()["fields"][0]["field"] == "query.limit"
        # ?tail=N: the newest N lines (oldest first), as a page and as the start of a stream.
        tail = h.get(f"/v1/jobs/{j.id}/logs", params={"tail": 2}).json()
        assert [x["line"] for x in tail["items"]] == ["line 3", "line 4"] and tail["next_after"] == tail["items"][-1]["id"]
        assert [x["line"] for x in h.get(f"/v1/jobs/{j.id}/logs", params={"tail": 99}).json()["items"]] == [
            f"line {i}" for i in range(5)]
        r = h.get(f"/v1/jobs/{j.id}/logs", params={"tail": 2, "follow": "true"})
        assert [f for f in r.text.split("\n\n") if f][-3:-1] == [
            f"id: {x['id']}\nevent: log\ndata: {json.dumps(x, separators=(',', ':'))}" for x in tail["items"]]
        assert r.text.count("event: log") == 2
        monkeypatch.setattr(jobs, "LOG_PAGE", 2)  # the tail found across pages of the store's reads
        assert [x["line"] for x in h.get(f"/v1/jobs/{j.id}/logs", params={"tail": 3}).json()["items"]] == [
            "line 2", "line 3", "line 4"]
        bad = h.get(f"/v1/jobs/{j.id}/logs", params={"tail": 0})
        assert bad.status_code == 422 and bad.json()["fields"][0]["field"] == "query.tail"


def test_cli_logs_follow_prints_lines_with_their_source(api: Api) -> None:
    _, token = api.user()
    with Client(api.url, token) as c:
        j = c.submit(TINY)
    t = _writer(api, j.id, LINES, then="FAILED")
    r = CliRunner().invoke(app, ["logs", j.id, "-f", "--url", api.url, "--token", token])
    t.join()
    assert r.exit_code == 0, r.output
    assert r.output.splitlines() == [f"[{src}] {text}" for src, text in LINES]
    r = CliRunner().invoke(app, ["logs", j.id, "--url", api.url, "--token", token])
    assert r.exit_code == 0 and r.output.splitlines()[0] == "[supervisor] starting 2 workers"
    r = CliRunner().invoke(app, ["logs", "nope", "--url", api.url, "--token", token])
    assert r.exit_code == 1 and "no job" in r.output
