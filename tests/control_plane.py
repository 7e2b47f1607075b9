"""A real control plane for end-to-end tests: the job store (SQLite), the scheduler and the API on a
background uvicorn server bound to 127.0.0.1, over whatever Ray cluster this process is connected to."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from api.app import create_app
from api.client import Client
from api.server import BackgroundServer
from service.scheduler import Scheduler
from service.store import JobStore


def until(check: Callable[[], Any], timeout: float, what: str, every_s: float = 0.25) -> Any:
    """check()'s first truthy answer, or AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class ControlPlane:
    def __init__(self, db: str) -> None:
        self.store = JobStore(db)
        self.scheduler = Scheduler(self.store, interval_s=0.2, liveness_every_s=1.0)
        self.scheduler.start()
        self.server = BackgroundServer(create_app(self.store, self.scheduler)).start()
        self.token = self.store.create_token("e2e", "user")

    def client(self) -> Client:
        return Client(self.server.url, self.token)

    def stop(self) -> None:
        self.server.stop()
        self.scheduler.stop()
        self.store.close()


def store_as_an_older_version_did(db: str, job_id: str, s3: dict[str, Any]) -> None:
    """Rewrite a stored job's spec with a checkpoint.s3 section this version refuses and older ones stored
    (an upgrade of the service finds such rows): straight into the table, as an older version wrote it."""
    import json

    from sqlalchemy import update

    from service.models import Job
    from service.store import JobStore

    store = JobStore(db)
    try:
        with store.engine.begin() as conn:
            for col in (Job.spec_json, Job.spec_public):
                raw = conn.execute(Job.__table__.select().where(Job.id == job_id)).mappings().one()[col.key]
                data = json.loads(raw)
                data["checkpoint"]["s3"] = s3
                conn.execute(update(Job).where(Job.id == job_id).values({col.key: json.dumps(data)}))
    finally:
        store.close()
