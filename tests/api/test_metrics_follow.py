"""A job's metrics as a live stream through a real server and store: GET /v1/jobs/{id}/metrics?follow=true
sends each row as the supervisor stores it (JobStore.add_metrics), one `metrics` Server-Sent Event a row
with the row's step as its id, and ends once the job has finished (rows flushed just after the final
status included); Last-Event-ID resumes after the step it names."""

from __future__ import annotations

import json
import threading

import httpx

from tests.api.conftest import Api

TINY = {"name": "tiny", "model": {"preset": "tiny"}, "training": {"steps": 3}}


def _row(step: int) -> dict[str, float | int]:
    return {"step": step, "loss": 5.0 - step / 10, "dp": 2, "generation": 0, "tokens_per_s": 1000.0 + step}


def _frames(text: str) -> list[dict[str, str]]:
    out = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line and not line.startswith(":"))
        if fields:
            out.append(fields)
    return out


def test_follow_streams_rows_as_stored_until_the_job_ends(api: Api) -> None:
    _, token = api.user()
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as h:
        job_id = h.post("/v1/jobs", json=TINY).json()["id"]
        api.store.set_status(job_id, "RUNNING")
        api.store.add_metrics(job_id, [_row(1), _row(2)])
        seen: list[int] = []
        arrived = {step: threading.Event() for step in (3, 4, 5)}
        late: list[int] = []

        def writer() -> None:
            # Each row is written only once the stream has sent the one before it, while the job
            # runs: a stream that sent rows only at the job's end would leave this waiting.
            for step in (3, 4, 5):
                api.store.add_metrics(job_id, [_row(step)])
                if not arrived[step].wait(15):
                    late.append(step)
            api.store.set_status(job_id, "SUCCEEDED")
            api.store.add_metrics(job_id, [_row(6)])  # the supervisor's last flush comes after the status

        t = threading.Thread(target=writer)
        t.start()
        kinds = []
        with h.stream("GET", f"/v1/jobs/{job_id}/metrics", params={"follow": "true", "poll_s": 0.1}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            buf = ""
            for chunk in r.iter_text():
                buf += chunk
                while "\n\n" in buf:
                    block, buf = buf.split("\n\n", 1)
                    f = _frames(block + "\n\n")
                    if not f:
                        continue
                    kinds.append(f[0]["event"])
                    if f[0]["event"] == "metrics":
                        row = json.loads(f[0]["data"])
                        assert f[0]["id"] == str(row["step"])
                        seen.append(row["step"])
                        if row["step"] in arrived:
                            arrived[row["step"]].set()
        t.join()
        assert not late, f"rows of steps {late} were not streamed while the job ran"
        assert seen == [1, 2, 3, 4, 5, 6]
        assert kinds[-1] == "end" and kinds.count("end") == 1

        # A finished job's stream sends what is stored after the step named, then ends; Last-Event-ID wins.
        r = h.get(f"/v1/jobs/{job_id}/metrics", params={"follow": "true", "after_step": 1},
                  headers={"Last-Event-ID": "4"})
        got = _frames(r.text)
        assert [x["id"] for x in got[:-1]] == ["5", "6"] and got[-1] == {"event": "end", "data": "{}"}
        # Without follow: the same rows as JSON.
        assert [x["step"] for x in h.get(f"/v1/jobs/{job_id}/metrics", params={"after_step": 3}).json()["items"]] == [
            4, 5, 6]
        bad = h.get(f"/v1/jobs/{job_id}/metrics", params={"follow": "true", "poll_s": 0})
        assert bad.status_code == 422 and bad.json()["fields"][0]["field"] == "query.poll_s"
        # Another user's job: 404, not a stream.
        _, other = api.user("other")
        r = h.get(f"/v1/jobs/{job_id}/metrics", params={"follow": "true"}, headers={"Authorization": f"Bearer {other}"})
        assert r.status_code == 404
