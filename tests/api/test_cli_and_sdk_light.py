"""`unbroken serve --no-ray` as a real process (token file, restart), the job commands against it,
and that `import unbroken` / `unbroken --help` load neither torch nor ray."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from api.cli import app
from workers.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "ray", "fastapi", "sqlalchemy", "uvicorn")


def _loaded_after(code: str) -> set[str]:
    probe = code + "\nimport sys, json; print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_sdk_and_help_import_no_torch_or_ray() -> None:
    mods = _loaded_after("import unbroken")
    assert not mods & {*HEAVY, "httpx", "pydantic"}, mods & {*HEAVY, "httpx", "pydantic"}
    mods = _loaded_after("from unbroken import Client, JobSpec, JobNotFound, ValidationFailed")
    assert not mods & set(HEAVY), mods & set(HEAVY)
    mods = _loaded_after(
        "import contextlib\nfrom api.cli import app\nwith contextlib.suppress(SystemExit):\n"
        "    app(['--help'], standalone_mode=True)"
    )
    assert not mods & set(HEAVY), mods & set(HEAVY)


class Served:
    def __init__(self, home: Path) -> None:
        self.home = home
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "UNBROKEN_HOME": str(self.home)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from api.cli import main; main()", "serve", "--no-ray", "--port", str(self.port)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"unbroken serve exited: {self.proc.stdout.read().decode()[-2000:]}")  # type: ignore[union-attr]
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError("unbroken serve did not become ready in 60 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    monkeypatch.setenv("UNBROKEN_HOME", str(tmp_path))
    monkeypatch.delenv("UNBROKEN_URL", raising=False)
    monkeypatch.delenv("UNBROKEN_TOKEN", raising=False)
    s = Served(tmp_path)
    s.start()
    try:
        yield s
    finally:
        s.stop()


def test_serve_token_file_cli_and_restart(served: Served, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    first = json.loads(token_file.read_text())
    assert first["url"] == served.url and first["token"].startswith("ubk_")

    runner = CliRunner()
    job_yaml = tmp_path / "job.yaml"
    job_yaml.write_text("name: cli-job\nmodel: {preset: tiny}\nruntime_env: {secret_env_vars: {K: hush-hush}}\n")
    r = runner.invoke(app, ["submit", str(job_yaml)])
    assert r.exit_code == 0, r.output
    job_id = r.output.strip()
    r = runner.invoke(app, ["list"])
    assert r.exit_code == 0 and job_id in r.output and "cli-job" in r.output
    r = runner.invoke(app, ["status", job_id, "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["status"] == "PENDING" and "hush-hush" not in r.output
    r = runner.invoke(app, ["status", job_id, "--checkpoints"])
    assert r.exit_code == 0 and "PENDING" in r.output and "STEP" in r.output

    bad = tmp_path / "bad.yaml"
    bad.write_text("parallelism: {tp: 3}\ntraining: {stepz: 1}\n")
    r = runner.invoke(app, ["submit", str(bad)])
    assert r.exit_code == 2 and "training.stepz" in r.output and "Extra inputs" in r.output, r.output
    # The object store's settings are checked at submission, not when a worker first writes.
    for spec, words in (
        ("{uri: 's3://ckpt/run', s3: {endpoint_url: '127.0.0.1:8333'}}",
         ("checkpoint.s3.endpoint_url", "must start with http:// or https://")),
        ("{uri: 's3://ckpt/run', s3: {access_key_id: AKID}}",
         ("checkpoint.s3", "access_key_id is set without secret_access_key", "set both, or neither")),
        ("{uri: 'ckpt/run'}", ("checkpoint.uri", "must start with file:// or s3://")),
    ):
        bad.write_text(f"name: bad-store\nmodel: {{preset: tiny}}\ncheckpoint: {spec}\n")
        r = runner.invoke(app, ["submit", str(bad)])
        assert r.exit_code == 2 and all(w in r.output for w in words), r.output
        assert "AKID" not in r.output  # a key is never echoed back
    r = runner.invoke(app, ["list"])
    assert r.exit_code == 0 and "bad-store" not in r.output  # nothing refused was stored

    r = runner.invoke(app, ["delete", job_id])
    assert r.exit_code == 1 and "cancel it" in r.output
    r = runner.invoke(app, ["cancel", job_id])
    assert r.exit_code == 0 and "CANCELLED" in r.output
    r = runner.invoke(app, ["events", job_id, "-f"])
    assert r.exit_code == 0 and "submitted" in r.output and "CANCELLED" in r.output
    r = runner.invoke(app, ["logs", job_id, "-f"])
    assert r.exit_code == 0

    # A restart keeps the job and the token file's admin token.
    keep = runner.invoke(app, ["submit", str(job_yaml)]).output.strip()
    served.stop()
    r = runner.invoke(app, ["list"])
    assert r.exit_code == 1 and "cannot reach" in r.output
    served.start()
    assert json.loads(token_file.read_text())["token"] == first["token"]
    r = runner.invoke(app, ["status", keep])
    assert r.exit_code == 0 and "PENDING" in r.output
    r = runner.invoke(app, ["delete", job_id])
    assert r.exit_code == 0
    r = runner.invoke(app, ["status", job_id])
    assert r.exit_code == 1 and "no job" in r.output
    r = runner.invoke(app, ["list"], env={"UNBROKEN_TOKEN": "ubk_wrong"})
    assert r.exit_code == 1 and "not valid" in r.output


def test_second_serve_on_a_busy_port_writes_nothing_and_says_why(served: Served, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    before = (token_file.read_bytes(), token_file.stat().st_mtime_ns)
    other_home = tmp_path / "other"
    for home in (tmp_path, other_home):  # the same home (its token file), and a fresh one
        env = {**os.environ, "UNBROKEN_HOME": str(home)}
        out = subprocess.run(
            [sys.executable, "-c", "from api.cli import main; main()", "serve", "--no-ray", "--port", str(served.port)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
        )
        assert out.returncode == 1, out.stdout + out.stderr
        assert f"port {served.port} on 127.0.0.1 is already in use" in out.stderr and "--port" in out.stderr
        assert "Traceback" not in out.stderr, out.stderr
    assert (token_file.read_bytes(), token_file.stat().st_mtime_ns) == before
    assert not other_home.exists() or not any(other_home.iterdir())  # no store, no token file
    # The first server still answers with its token.
    token = json.loads(before[0])["token"]
    assert httpx.get(f"{served.url}/v1/jobs", headers={"Authorization": f"Bearer {token}"}).status_code == 200
