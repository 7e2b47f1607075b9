"""Throwaway databases for store and API tests: a SQLite file, or a fresh PostgreSQL database
(127.0.0.1:5432, user postgres, trust auth) created for the test and dropped afterwards."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

PG_ADMIN = "host=127.0.0.1 port=5432 user=postgres dbname=test connect_timeout=3"
BACKENDS = ["sqlite", "postgresql"]


def _pg_admin_conn():  # noqa: ANN202 - psycopg is imported lazily
    import psycopg

    return psycopg.connect(PG_ADMIN, autocommit=True)


@contextlib.contextmanager
def database(kind: str, tmp: Path) -> Iterator[str]:
    """Yield a store URL of a new, empty database of `kind`; drop it afterwards."""
    if kind == "sqlite":
        yield f"sqlite:///{tmp / 'unbroken.db'}"
        return
    try:
        admin = _pg_admin_conn()
    except Exception as e:  # no server here: the SQLite half still runs
        pytest.skip(f"PostgreSQL at 127.0.0.1:5432 is not reachable: {e}")
    name = f"unbroken_test_{uuid.uuid4().hex[:12]}"
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    finally:
        with _pg_admin_conn() as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
