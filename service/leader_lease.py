"""The scheduler's leader lease among API processes sharing one PostgreSQL (JobStore.leader_lease)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

log = logging.getLogger(__name__)


class LeaderLease:
    """Leadership among processes sharing one PostgreSQL: a session-level advisory lock held on a
    connection of its own. The database frees it the moment that connection ends (the process died,
    the network cut it, the server restarted), so another process's `hold()` takes it within one poll.
    On SQLite (one process by design) the lease is always held."""

    def __init__(self, engine: Engine, key: int) -> None:
        self.engine = engine
        self.key = key
        self._conn: Any = None
        self.is_postgres = engine.dialect.name == "postgresql"

    def hold(self) -> bool:
        """True while this process leads: checks the held lock's connection, or tries to take it."""
        if not self.is_postgres:
            return True
        try:
            if self._conn is not None:
                self._conn.exec_driver_sql("SELECT 1")
                self._conn.commit()
                return True
            conn = self.engine.connect()
            got = conn.exec_driver_sql(f"SELECT pg_try_advisory_lock({int(self.key)})").scalar()
            conn.commit()  # the session lock outlives the transaction; no transaction stays open
            if got:
                self._conn = conn
                return True
            conn.close()
            return False
        except DBAPIError as e:
            log.warning("leader lease lost (%s: %s)", type(e).__name__, e)
            self._drop()
            return False

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # already gone
                conn.invalidate()  # never back to the pool: the lock must die with this session

    def release(self) -> None:
        if self._conn is not None:
            try:
                self._conn.exec_driver_sql(f"SELECT pg_advisory_unlock({int(self.key)})")
                self._conn.commit()
            except DBAPIError:
                pass
            self._drop()
