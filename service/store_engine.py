"""The job store's database plumbing: engines for SQLite and PostgreSQL, Alembic migrations, retrying a
write while the database is unreachable, and the small encodings (ids, cursors, JSON) its tables share."""

from __future__ import annotations

import base64
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

log = logging.getLogger("service.store")

MIGRATIONS_DIR = Path(__file__).with_name("migrations")


def store_unavailable(exc: BaseException) -> bool:
    """The database cannot be reached right now (down, restarting, connection cut): worth retrying."""
    return isinstance(exc, OperationalError | InterfaceError) or (
        isinstance(exc, DBAPIError) and bool(exc.connection_invalidated))


P = ParamSpec("P")
R = TypeVar("R")


def retried(budget_attr: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Retry a whole write (its own transaction) while the store is unavailable, for `self.<budget_attr>`
    seconds; then the last error propagates (the API maps it to 503). Each write is one transaction
    that either committed or did not, and the writes are conditional or append-only, so a retry after
    a lost connection does not change a job twice."""

    def deco(fn: Callable[P, R]) -> Callable[P, R]:
        @wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            store = args[0]
            deadline = time.monotonic() + float(getattr(store, budget_attr))
            pause = 0.1
            while True:
                try:
                    return fn(*args, **kwargs)
                except DBAPIError as e:
                    if not store_unavailable(e) or time.monotonic() + pause > deadline:
                        raise
                    log.warning("job store unavailable in %s (%s); retrying in %.1f s",
                                fn.__name__, type(e.orig).__name__, pause)
                    time.sleep(pause)
                    pause = min(pause * 2, 2.0)

        return wrapper

    return deco


def new_job_id() -> str:
    return uuid.uuid4().hex[:16]


def json_safe(x: Any) -> Any:
    """Non-finite floats become None: PostgreSQL's JSON has no NaN/Infinity."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    if hasattr(x, "item") and callable(x.item):  # numpy / torch scalars
        return json_safe(x.item())
    return x


def encode_cursor(seq: int) -> str:
    return base64.urlsafe_b64encode(f"s{seq}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> int:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        if not raw.startswith("s"):
            raise ValueError(cursor)
        seq = int(raw[1:])
        if seq < 0 or seq > 2**62:
            raise ValueError(cursor)
        return seq
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"cursor {cursor!r} is not one this server gave out; drop it to start over") from e


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    # WAL lets the API read while supervisors write; busy_timeout waits for a writer instead of failing.
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[1] if "///" in url else ""
        if path and path != ":memory:":
            Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    if url.startswith("postgresql"):
        # pre_ping drops connections a database restart cut; connect_timeout bounds a hung server.
        return create_engine(url, pool_size=10, max_overflow=20, pool_pre_ping=True,
                             connect_args={"connect_timeout": 5})
    raise ValueError(f"store url {url!r} must be sqlite:///PATH or postgresql+psycopg://USER@HOST/DB")


_migrate_lock = threading.Lock()


def migrate(engine: Engine) -> None:
    """Bring the schema to the newest Alembic revision (a no-op when it is there already)."""
    from alembic import command
    from alembic.config import Config
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    head = ScriptDirectory.from_config(cfg).get_current_head()
    with engine.connect() as conn:
        if MigrationContext.configure(conn).get_current_revision() == head:
            return
    with _migrate_lock, engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # Several processes may open the store at once; one migrates, the rest wait.
            conn.exec_driver_sql("SELECT pg_advisory_xact_lock(74281953)")
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
