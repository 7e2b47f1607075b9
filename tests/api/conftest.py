"""A real uvicorn server on a free 127.0.0.1 port, store-only (no Ray: jobs stay PENDING),
over SQLite and over a fresh PostgreSQL database; stopped and dropped even on failure."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from api.app import create_app
from api.server import BackgroundServer
from service.store import JobStore
from tests.service.databases import BACKENDS, database

CLUSTER = {"CPU": 8.0}  # what the store-only server believes the cluster holds (for 422 on size)


@dataclass
class Api:
    url: str
    db_url: str
    store: JobStore
    admin_token: str
    server: BackgroundServer

    def user(self, prefix: str = "user") -> tuple[str, str]:
        """A fresh principal and its token, so tests on one server do not see each other's jobs."""
        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        return name, self.store.create_token(name, "user")


@pytest.fixture(scope="module", params=BACKENDS)
def api(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    with database(request.param, tmp_path_factory.mktemp("db")) as url:
        store = JobStore(url)
        server = BackgroundServer(create_app(store, None, max_body_bytes=64 * 1024, cluster_total=CLUSTER))
        server.start()
        try:
            yield Api(server.url, url, store, store.create_token("root", "admin"), server)
        finally:
            server.stop()
            store.close()
