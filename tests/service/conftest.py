from __future__ import annotations

from collections.abc import Iterator

import pytest

from service.store import JobStore
from tests.service.databases import BACKENDS, database


@pytest.fixture(params=BACKENDS)
def job_store(request: pytest.FixtureRequest, tmp_path) -> Iterator[JobStore]:  # noqa: ANN001
    with database(request.param, tmp_path) as url:
        s = JobStore(url)
        try:
            yield s
        finally:
            s.close()
