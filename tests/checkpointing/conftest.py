"""A private SeaweedFS S3 server for the checkpointing tests: one per session, always stopped."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from checkpointing.local_s3 import LocalS3Server


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalS3Server]:
    server = LocalS3Server(tmp_path_factory.mktemp("seaweedfs"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: LocalS3Server, request: pytest.FixtureRequest) -> str:
    """A fresh bucket per test (names: 3-63 lowercase letters, digits, '-')."""
    name = ("t-" + request.node.name.lower().replace("_", "-"))[:50].strip("-") + "-b"
    s3_server.create_bucket(name)
    return name
