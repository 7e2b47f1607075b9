"""A PostgreSQL server of the test's own (Debian's initdb/pg_ctl, a free 127.0.0.1 port, trust auth),
so a test may stop, restart or kill it without touching the machine's server at 5432. As root the
server runs as the `postgres` user (initdb refuses root). Removed afterwards, even on failure."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from workers.ports import free_port


def _bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not found:
        pytest.skip(f"PostgreSQL's {name} is not installed (apt-get install postgresql)")
    return found[-1]


class PrivatePostgres:
    def __init__(self, root: Path, port: int) -> None:
        self.root = root
        self.data = root / "data"
        self.port = port
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"

    def _run(self, *args: str, timeout: float = 60) -> None:
        cmd = list(args)
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed: {out.stdout[-800:]} {out.stderr[-800:]}")

    def start(self) -> None:
        opts = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} -F"
        self._run(_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.root / "log"), "-o", opts, "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        """fast: clients are cut off and the server shuts down cleanly; immediate: as a crash."""
        self._run(_bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def restart_after(self, down_s: float) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()


@contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    root = Path(tempfile.mkdtemp(prefix="unbroken-pg-"))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
    pg = PrivatePostgres(root, free_port())
    started = False
    try:
        pg._run(_bin("initdb"), "-D", str(pg.data), "-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8")
        pg.start()
        started = True
        yield pg
    finally:
        if started:
            with contextlib.suppress(RuntimeError):  # stopped already by the test
                pg.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)
