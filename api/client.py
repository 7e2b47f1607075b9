"""The Python SDK: `Client` talks to the Unbroken REST API with httpx.

    from unbroken import Client
    c = Client()                      # the local server's URL and token from ~/.unbroken/token
    job = c.submit("job.yaml")
    c.wait(job.id, progress_callback=print)  # one line per change: step, loss, tokens/s, dp, ...

`wait()` raises JobFailed when the job ends FAILED and JobCancelled when it ends CANCELLED (as
concurrent.futures does), unless raise_on_failure=False; then it returns the final job whatever
its status.

Imports neither torch nor ray (nor the server): only httpx, pydantic and the API's models.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from api import errors, schemas
from api.schemas import Checkpoint, Goodput, Job, JobEvent, JobList, LogLine, LogList
from service.statuses import CANCELLED, FAILED

DEFAULT_URL = "http://127.0.0.1:8420"
M = TypeVar("M", JobEvent, LogLine)


@dataclass(frozen=True)
class JobProgress:
    """What `Client.wait` hands its progress_callback: a job's status and newest step, no spec.
    Fields unknown yet (before the first step) are None; str() is one readable line."""

    job_id: str
    status: str
    step: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    dp: int | None = None
    generation: int | None = None
    recoveries: int = 0
    reason: str | None = None
    eval_loss: float | None = None
    spares: int | None = None  # warm spare replicas ready (jobs with resources.spares)

    @classmethod
    def of(cls, job: Job) -> JobProgress:
        p = job.progress
        return cls(job_id=job.id, status=job.status, step=p.step, total_steps=p.total_steps, loss=p.loss,
                   tokens_per_s=p.tokens_per_s, dp=p.dp, generation=p.generation, recoveries=p.recoveries,
                   reason=job.reason, eval_loss=p.eval_loss, spares=p.spares)

    def __str__(self) -> str:
        parts = [f"job {self.job_id} {self.status}"]
        if self.step is not None or self.total_steps is not None:
            parts.append(f"step {self.step or 0}" + (f"/{self.total_steps}" if self.total_steps is not None else ""))
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.eval_loss is not None:
            parts.append(f"eval loss {self.eval_loss:.4f}")
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:,.0f} tokens/s")
        if self.dp is not None:
            parts.append(f"dp {self.dp}" + (f" (+{self.spares} spare)" if self.spares else ""))
        if self.generation is not None:
            parts.append(f"generation {self.generation}")
        if self.recoveries:
            parts.append(f"{self.recoveries} {'recovery' if self.recoveries == 1 else 'recoveries'}")
        line = ", ".join(parts)
        return f"{line}: {self.reason}" if self.reason and self.status in (FAILED, CANCELLED) else line


def _spec_body(spec: Any, headers: dict[str, str], verb: str) -> dict[str, Any]:
    """httpx request arguments carrying a job spec: a job.yaml path as YAML, a dict or JobSpec as JSON."""
    if isinstance(spec, str | Path):
        path = Path(spec)
        if not path.is_file():
            raise errors.ValidationFailed(f"job file {str(path)!r} does not exist", {"path": "no such file"})
        return {"content": path.read_bytes(), "headers": {**headers, "Content-Type": "application/yaml"}}
    if isinstance(spec, dict):
        return {"json": spec, "headers": headers}
    if hasattr(spec, "model_dump"):
        from service.spec import reveal_secrets  # a JobSpec object: the spec module is loaded already

        data = reveal_secrets(spec.model_dump(mode="python"))
        p = getattr(spec, "parallelism", None)
        if getattr(p, "auto", False):
            # With auto, the sizes the user set are the ones the planner keeps: send only those.
            data["parallelism"] = p.model_dump(mode="python", exclude_unset=True)
        return {"content": json.dumps(data, default=str), "headers": {**headers, "Content-Type": "application/json"}}
    raise TypeError(f"{verb}() takes a JobSpec, a dict or a path, not {type(spec).__name__}")


def resolve_connection(url: str | None = None, token: str | None = None) -> tuple[str, str | None]:
    """Explicit arguments, else $UNBROKEN_URL / $UNBROKEN_TOKEN, else the local token file. The URL may
    list several API servers of one control plane, comma-separated (see Client)."""
    from service.auth import read_token_file

    file = read_token_file() or {}
    url = url or os.environ.get("UNBROKEN_URL") or file.get("url") or DEFAULT_URL
    token = token or os.environ.get("UNBROKEN_TOKEN") or file.get("token")
    return url.rstrip("/"), token


class Client:
    """A connection to an Unbroken control plane. Every refusal raises a typed api.errors error.

    `url` (or $UNBROKEN_URL) may name several API servers sharing one store, comma-separated
    ("http://a:8420,http://b:8420"): a server that cannot be reached is skipped for the next, for up
    to `retry_s` seconds (a request that may have reached a dead server is retried only if it is
    safe to repeat: any GET or DELETE, a POST with an Idempotency-Key, as every submit has, or one
    that never connected). An answer 503 (the store
    is restarting) is retried after its Retry-After for up to `retry_s` seconds, on any server."""

    def __init__(self, url: str | None = None, token: str | None = None, *, timeout: float = 30.0,
                 retry_s: float = 30.0) -> None:
        joined, self.token = resolve_connection(url, token)
        self.urls = [u.strip().rstrip("/") for u in joined.split(",") if u.strip()] or [DEFAULT_URL]
        self.url = self.urls[0]
        self.retry_s = retry_s
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- plumbing -------------------------------------------------------------------------------

    def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        deadline = time.monotonic() + self.retry_s
        failed_in_row = 0
        while True:
            try:
                r = self._http.request(method, self.url + path, **kw)
            except httpx.TransportError as e:
                failed_in_row += 1
                repeatable = (method != "POST" or isinstance(e, httpx.ConnectError | httpx.ConnectTimeout)
                              or "Idempotency-Key" in (kw.get("headers") or {}))
                if len(self.urls) == 1 or not repeatable or time.monotonic() >= deadline:
                    raise errors.ServerUnavailable(
                        f"cannot reach the Unbroken API at {', '.join(self.urls)} ({type(e).__name__}: {e}); "
                        "start it with `unbroken serve` or pass url="
                    ) from e
                self.url = self.urls[(self.urls.index(self.url) + 1) % len(self.urls)]
                if failed_in_row % len(self.urls) == 0:
                    time.sleep(min(0.25 * failed_in_row, 2.0))  # every server failed once: pause
                continue
            failed_in_row = 0
            if r.status_code == 503 and time.monotonic() < deadline:
                try:
                    wait = float(r.headers.get("Retry-After", "1"))
                except ValueError:
                    wait = 1.0
                time.sleep(max(0.05, min(wait, 10.0, deadline - time.monotonic())))
                continue
            break
        if r.status_code >= 400:
            try:
                body = r.json()
            except ValueError:
                body = None
            raise errors.error_from_response(r.status_code, body, r.text[:500])
        return r

    # ---- jobs -----------------------------------------------------------------------------------

    def submit(self, spec: Any, *, idempotency_key: str | None = None) -> Job:
        """Submit a JobSpec, a dict of sections, or the path of a job.yaml; returns the stored job.
        Without an idempotency_key the SDK makes one, so a retry on another server never submits twice."""
        headers = {"Idempotency-Key": idempotency_key or f"sdk-{uuid.uuid4().hex}"}
        r = self._request("POST", "/v1/jobs", **_spec_body(spec, headers, "submit"))
        return Job.model_validate(r.json())

    def plan(self, spec: Any, gpus: int | None = None, gpu: str | None = None, nodes: int | None = None) -> dict:
        """The planner's layouts for a job (JobSpec, dict or job.yaml path) on a cluster: `gpus`
        devices of preset `gpu` (h100, h200, a100, cpu) on `nodes` nodes, by default the cluster
        the job would run on. Nothing is stored. `ok` is false when no layout fits (`reasons`)."""
        params = {k: v for k, v in (("gpus", gpus), ("gpu", gpu), ("nodes", nodes)) if v is not None}
        return self._request("POST", "/v1/plan", params=params, **_spec_body(spec, {}, "plan")).json()

    def get(self, job_id: str) -> Job:
        return Job.model_validate(self._request("GET", f"/v1/jobs/{job_id}").json())

    def list(
        self,
        *,
        status: str | list[str] | None = None,
        owner: str | None = None,
        name: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> JobList:
        """One page of jobs, newest first; pass `.next_cursor` back as cursor= for the next page."""
        params: dict[str, Any] = {"limit": limit}
        if status:
            params["status"] = status if isinstance(status, str) else ",".join(status)
        for k, v in (("owner", owner), ("name", name), ("cursor", cursor)):
            if v is not None:
                params[k] = v
        return JobList.model_validate(self._request("GET", "/v1/jobs", params=params).json())

    def iter_jobs(self, **filters: Any) -> Iterator[Job]:
        """Every job matching the filters, page by page."""
        cursor = None
        while True:
            page = self.list(cursor=cursor, **filters)
            yield from page.items
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    def wait(
        self,
        job_id: str,
        timeout: float | None = None,
        progress_callback: Callable[[JobProgress], None] | None = None,
        *,
        poll_s: float = 1.0,
        raise_on_failure: bool = True,
    ) -> Job:
        """Poll until the job finishes and return it when it SUCCEEDED.

        progress_callback gets a JobProgress each time it changes (the last one is the final
        status). A FAILED job raises JobFailed, a CANCELLED one JobCancelled; with
        raise_on_failure=False the final job is returned whatever its status. TimeoutError
        after `timeout` s.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        last: JobProgress | None = None
        while True:
            job = self.get(job_id)
            if progress_callback is not None:
                now = JobProgress.of(job)
                if now != last:
                    progress_callback(now)
                    last = now
            if job.terminal:
                if raise_on_failure and job.status == FAILED:
                    raise errors.JobFailed(job)
                if raise_on_failure and job.status == CANCELLED:
                    raise errors.JobCancelled(job)
                return job
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} is still {job.status} after {timeout} s")
            time.sleep(poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic())))

    def cancel(self, job_id: str) -> Job:
        return Job.model_validate(self._request("POST", f"/v1/jobs/{job_id}/cancel").json())

    def delete(self, job_id: str) -> None:
        self._request("DELETE", f"/v1/jobs/{job_id}")

    def events(self, job_id: str, follow: bool = True, *, after: int = 0) -> Iterator[JobEvent]:
        """The job's events; with follow=True, keep streaming (SSE) until the job finishes."""
        if not follow:
            body = self._request("GET", f"/v1/jobs/{job_id}/events", params={"after": after}).json()
            yield from (JobEvent.model_validate(e) for e in body["items"])
            return
        yield from self._follow(f"/v1/jobs/{job_id}/events", job_id, after, JobEvent)

    def logs(self, job_id: str, follow: bool = False, *, after: int = 0) -> Iterator[LogLine]:
        """The job's stored log lines, oldest first (each with its source, e.g. "rank 0"); with
        follow=True, keep streaming new ones (SSE) until the job finishes."""
        if follow:
            yield from self._follow(f"/v1/jobs/{job_id}/logs", job_id, after, LogLine)
            return
        while True:
            page = LogList.model_validate(
                self._request("GET", f"/v1/jobs/{job_id}/logs", params={"after": after, "limit": 1000}).json()
            )
            yield from page.items
            if len(page.items) < 1000:
                return
            after = page.next_after

    def _follow(self, path: str, job_id: str, after: int, model: type[M]) -> Iterator[M]:
        """Items of an SSE stream (`data:` JSON with an `id`) until its `end` event; a broken stream
        is resumed after the last id seen."""
        last = after
        while True:
            try:
                with self._http.stream("GET", self.url + path, params={"follow": "true", "after": last},
                                       timeout=httpx.Timeout(self._http.timeout.connect, read=None)) as r:
                    if r.status_code >= 400:
                        r.read()
                        try:
                            body = r.json()
                        except ValueError:
                            body = None
                        raise errors.error_from_response(r.status_code, body, r.text[:500])
                    kind, data = "message", ""
                    for line in r.iter_lines():
                        if line.startswith("event:"):
                            kind = line[6:].strip()
                        elif line.startswith("data:"):
                            data += line[5:].strip()
                        elif line == "":
                            if kind == "end":
                                return
                            if data:
                                item = model.model_validate_json(data)
                                last = item.id  # type: ignore[attr-defined]
                                yield item
                            kind, data = "message", ""
            except httpx.TransportError as e:
                # The stream broke (server restart, proxy timeout): resume after the last item seen.
                try:
                    self.get(job_id)
                except errors.ServerUnavailable:
                    raise errors.ServerUnavailable(f"lost the stream {path}: {e}") from e
                time.sleep(0.5)

    # ---- admins: tokens and the audit log (plain dicts, as the API answers) -----------------------

    def create_token(self, principal: str, *, role: str = "user", label: str | None = None,
                     expires_in_s: float | None = None, weight: float | None = None) -> dict[str, Any]:
        """A new token for `principal`; its text is in ["token"], shown this once. `weight`: the owner's
        fair share of spare capacity (default 1; an owner's weight is the largest of its tokens')."""
        body = {"principal": principal, "role": role, "label": label, "expires_in_s": expires_in_s, "weight": weight}
        return self._request("POST", "/v1/tokens", json={k: v for k, v in body.items() if v is not None}).json()

    def tokens(self, *, principal: str | None = None, include_revoked: bool = False) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"include_revoked": include_revoked}
        if principal is not None:
            params["principal"] = principal
        return self._request("GET", "/v1/tokens", params=params).json()["items"]

    def revoke_token(self, token_id: int) -> dict[str, Any]:
        return self._request("DELETE", f"/v1/tokens/{int(token_id)}").json()

    def audit(self, *, after_id: int = 0, limit: int = 100, principal: str | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"after_id": after_id, "limit": limit}
        if principal is not None:
            params["principal"] = principal
        return self._request("GET", "/v1/audit", params=params).json()

    def metrics(self, job_id: str, *, after_step: int = -1) -> list[dict[str, Any]]:
        """One dict a step (step, loss, tokens, dp, ...), oldest first, every page of them; []
        before the first step."""
        page_size = 10000
        out: list[dict[str, Any]] = []
        while True:
            params = {"after_step": after_step, "limit": page_size}
            page = list(self._request("GET", f"/v1/jobs/{job_id}/metrics", params=params).json()["items"])
            if len(page) < page_size:
                return out + page
            # A full page may end inside a step's rows: keep the whole steps, ask again from the last one.
            last = page[-1]["step"]
            whole = [r for r in page if r["step"] != last]
            if not whole:
                return out + page
            out += whole
            after_step = last - 1

    def checkpoints(self, job_id: str) -> list[Checkpoint]:
        body = self._request("GET", f"/v1/jobs/{job_id}/checkpoints").json()
        return [Checkpoint.model_validate(c) for c in body["items"]]

    def goodput(self, job_id: str) -> Goodput:
        """How much of the job's wall time since its first step went into steps, and what paused it."""
        return Goodput.model_validate(self._request("GET", f"/v1/jobs/{job_id}/goodput").json())

    def health(self) -> dict[str, Any]:
        return dict(self._request("GET", "/readyz").json())


__all__ = ["Client", "Job", "JobProgress", "JobEvent", "JobList", "LogLine", "LogList", "Checkpoint", "schemas", "resolve_connection"]
