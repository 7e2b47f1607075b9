"""A job's log lines in the store, on SQLite and PostgreSQL: sources and timestamps kept, each job
bounded (the oldest dropped, one marker line saying how many), long lines cut, and the 0001 -> 0002
migration keeping lines written before it."""

from __future__ import annotations

import pytest

from service.spec import parse_spec
from service.store import LOG_MARKER_SOURCE, MAX_LOG_LINE_CHARS, JobStore, make_engine
from tests.service.databases import BACKENDS, database


def _job(store: JobStore) -> str:
    job, _ = store.create_job(parse_spec({"name": "t"}), "alice", min_world=1, max_world=1)
    return job.id


@pytest.mark.parametrize("backend", BACKENDS)
def test_logs_are_bounded_per_job_with_a_marker(backend: str, tmp_path) -> None:  # noqa: ANN001
    with database(backend, tmp_path) as url:
        store = JobStore(url, max_log_lines=10)
        try:
            a, b = _job(store), _job(store)
            store.add_logs(a, [(100.0 + i, f"rank {i % 2}", f"a{i}") for i in range(6)])
            store.add_log(b, ["b0", "b1"], source="supervisor")
            got = store.logs(a)
            assert [(x.ts, x.source, x.line) for x in got[:2]] == [(100.0, "rank 0", "a0"), (101.0, "rank 1", "a1")]
            assert [x.source for x in store.logs(b)] == ["supervisor", "supervisor"]

            # Over the limit: the newest 9 lines stay, after one marker that reads first.
            store.add_logs(a, [(200.0 + i, "rank 0", f"a{6 + i}") for i in range(7)])
            got = store.logs(a)
            assert len(got) == 10 and got[0].source == LOG_MARKER_SOURCE
            assert got[0].line == "4 older log lines dropped: a job keeps its newest 10 lines"
            assert [x.line for x in got[1:]] == [f"a{i}" for i in range(4, 13)]
            assert [x.id for x in got] == sorted(x.id for x in got)
            # Again: the count adds up, and a follower reading after an old id still finds the marker.
            store.add_logs(a, [(300.0, None, "a13"), (301.0, None, "a14")])
            got = store.logs(a)
            assert got[0].line.startswith("6 older log lines dropped") and got[-1].line == "a14"
            assert [x.line for x in store.logs(a, after_id=0)][:2] == [got[0].line, "a6"]
            # One batch larger than the whole limit.
            store.add_logs(a, [(400.0, "rank 1", f"big{i}") for i in range(25)])
            got = store.logs(a)
            assert len(got) == 10 and got[0].line.startswith("31 older log lines dropped")
            assert got[-1].line == "big24"
            # The other job was never touched.
            assert [x.line for x in store.logs(b)] == ["b0", "b1"]

            # A runaway line is cut, and says so; a trailing newline is not kept.
            store.add_log(b, ["x" * (MAX_LOG_LINE_CHARS + 5), "ends\n"])
            cut, plain = store.logs(b)[-2:]
            assert cut.line == "x" * MAX_LOG_LINE_CHARS + "... (5 more characters cut)" and plain.line == "ends"
            store.add_logs("nope", [(1.0, "rank 0", "dropped")])  # an unknown job: dropped, not raised
            assert store.logs("nope") == []
            with pytest.raises(ValueError, match="max_log_lines"):
                JobStore(url, max_log_lines=1)
        finally:
            store.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_migration_keeps_lines_written_before_sources(backend: str, tmp_path) -> None:  # noqa: ANN001
    from alembic import command
    from alembic.config import Config

    from service.store import MIGRATIONS_DIR

    with database(backend, tmp_path) as url:
        engine = make_engine(url)
        cfg = Config()
        cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "0001")
            conn.exec_driver_sql("INSERT INTO logs (job_id, ts, line) VALUES ('j1', 1.0, 'old line')")
        engine.dispose()
        store = JobStore(url)
        try:
            got = store.logs("j1")
            assert [(x.line, x.source) for x in got] == [("old line", None)]
        finally:
            store.close()
