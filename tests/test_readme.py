"""Every code block of README.md, run as a new user would: against a real `unbroken serve` process
(a private port, UNBROKEN_HOME and token file in a temporary folder, its own embedded Ray cluster).

The blocks are read from README.md when the tests run, so the test follows the text:
- yaml/json blocks that look like a job must be valid job specs as written;
- python blocks run as written, each in a fresh interpreter, in a folder holding `job.yaml`;
- each `unbroken ...` line of a bash block runs (`make ...` lines do not: they are the suite and the
  demo themselves). `a | b | c` lines whose later parts are not commands list alternatives
  (`unbroken list | status JOB`) and run one by one. Placeholders are filled in: JOB (the job the
  README submitted; a fresh one for cancel/delete), RUN_DIR, OUT_DIR, URI and s3://bucket/... (that
  job's output and checkpoints), `[...]` options are dropped, 127.0.0.1:8420 is the test's server.
  `unbroken serve` is the test's own server (its options are only parsed); `unbroken train` and
  `unbroken run` start engines of their own without the server and are parsed here, run by
  tests/api/test_cli_train.py and tests/runtime/test_cli_run.py.

`job.yaml` is the README's job block made tiny so this runs in about two minutes: training.steps
small (chaos steps and persist_every within it), an s3:// checkpoint root moved to a local folder
(no object store here), a data.path that this machine lacks replaced by this Python's stdlib.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer.main
import yaml

from api.cli import app
from workers.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
VENV_BIN = Path(sys.executable).parent
TINY_STEPS = 8
COMMAND_TIMEOUT_S = 240
LOCAL_ENGINE_COMMANDS = {"train", "run"}  # parsed here; run by their own tests (see the docstring)
JOB_SECTIONS = {"name", "priority", "model", "data", "training", "parallelism", "resources", "checkpoint",
                "fault_tolerance", "chaos", "runtime_env", "tensorboard"}


@dataclass
class Block:
    lang: str
    text: str
    line: int  # where the block starts in README.md

    def where(self) -> str:
        return f"README.md:{self.line} ({self.lang or 'plain'} block)"


def readme_blocks() -> list[Block]:
    text = README.read_text(encoding="utf-8")
    out = []
    for m in re.finditer(r"^```([\w+-]*)[^\n]*\n(.*?)^```", text, re.M | re.S):
        out.append(Block(m.group(1).lower(), m.group(2), text.count("\n", 0, m.start()) + 1))
    return out


def job_like(data: Any) -> bool:
    return isinstance(data, dict) and bool(data) and set(data) <= JOB_SECTIONS


def readme_jobs() -> list[tuple[Block, dict[str, Any]]]:
    jobs = []
    for b in readme_blocks():
        if b.lang in ("yaml", "yml", "json"):
            try:
                data = yaml.safe_load(b.text)
            except yaml.YAMLError:
                data = None
            if job_like(data):
                jobs.append((b, data))
    return jobs


def tiny_job(job: dict[str, Any], ckpt_root: Path) -> dict[str, Any]:
    """The README's job, small and local (see the module docstring); every other field as written."""
    job = json.loads(json.dumps(job))
    training = job.setdefault("training", {})
    steps = min(int(training.get("steps", TINY_STEPS)), TINY_STEPS)
    training["steps"] = steps
    if "warmup_steps" in training:
        training["warmup_steps"] = min(int(training["warmup_steps"]), steps)
    for i, ev in enumerate(job.get("chaos") or []):
        ev["step"] = min(int(ev.get("step", 0)), max(1, steps // 2) + i)
    ck = job.get("checkpoint") or {}
    if str(ck.get("uri", "")).startswith("s3://"):
        ck["uri"] = ckpt_root.as_uri()
        ck.pop("s3", None)
    if ck.get("persist_every"):
        ck["persist_every"] = min(int(ck["persist_every"]), max(1, steps // 2))
    data = job.get("data") or {}
    if data.get("path") and not Path(data["path"]).exists():
        data["path"] = sysconfig.get_paths()["stdlib"]
    return job


@dataclass
class Served:
    """`unbroken serve` as a user starts it, in its own process group (so its Ray goes with it)."""

    home: Path
    work: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[str] | None = None
    log: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")}
        env.update(UNBROKEN_HOME=str(self.home), PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
                   OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), RAY_TMPDIR=str(self.home / "ray"),
                   COLUMNS="200", NO_COLOR="1")
        return env

    def start(self) -> None:
        (self.home / "ray").mkdir(parents=True)
        self.log = self.home / "serve.log"
        cmd = [str(VENV_BIN / "unbroken"), "serve", "--port", str(self.port), "--num-cpus", "6"]
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(cmd, cwd=self.work, env=self.env(), stdout=out, stderr=subprocess.STDOUT,
                                         text=True, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"unbroken serve exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        raise RuntimeError(f"unbroken serve was not ready in 120 s: {self.log.read_text()[-3000:]}")

    def tail(self) -> str:
        """The server's own output, for a failure's message."""
        text = self.log.read_text(errors="replace")[-3000:] if self.log and self.log.exists() else ""
        return f"\n\n--- unbroken serve's output (tail) ---\n{text}"

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError):  # what its Ray left behind, by our group id only
            os.killpg(self.proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    jobs = readme_jobs()
    if not jobs:
        pytest.fail("README.md has no job block (yaml with model/training/... sections) to write job.yaml from")
    # A short folder: Ray's unix sockets live under RAY_TMPDIR and their paths are limited to 107 bytes.
    base = Path(tempfile.mkdtemp(prefix="ubrm-", dir="/tmp"))
    s = Served(home=base / "home", work=base / "work")
    s.work.mkdir(parents=True)
    (s.work / "job.yaml").write_text(yaml.safe_dump(tiny_job(jobs[0][1], base / "ckpt"), sort_keys=False))
    try:
        s.start()
        yield s
    finally:
        s.stop()
        import shutil

        shutil.rmtree(base, ignore_errors=True)


def test_job_blocks_are_valid_jobs_as_written() -> None:
    from service.spec import SpecError, parse_spec

    jobs = readme_jobs()
    assert jobs, "README.md has no job block"
    bad = []
    for b, data in jobs:
        try:
            parse_spec(data)
        except SpecError as e:
            bad.append(f"{b.where()}: {e}")
    assert not bad, "README job blocks that are refused:\n" + "\n".join(bad)


def test_python_blocks_run_as_written(served: Served) -> None:
    blocks = [b for b in readme_blocks() if b.lang in ("python", "py", "python3")]
    assert blocks, "README.md has no python block"
    failed = []
    for b in blocks:
        try:
            t0 = time.monotonic()
            out = subprocess.run([sys.executable, "-c", b.text], cwd=served.work, env=served.env(),
                                 capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
            print(f"{b.where()}: exit {out.returncode} in {time.monotonic() - t0:.1f} s:\n{out.stdout[-2000:]}")
            if out.returncode != 0:
                failed.append(f"{b.where()} exited {out.returncode}:\n{out.stdout[-1500:]}\n{out.stderr[-3000:]}")
        except subprocess.TimeoutExpired as e:
            failed.append(f"{b.where()} ran past {COMMAND_TIMEOUT_S} s: {str(e.stdout)[-1500:]}")
    assert not failed, "README python blocks that fail:\n\n" + "\n\n".join(failed) + served.tail()


# ---- bash blocks ---------------------------------------------------------------------------------


def shell_lines(text: str) -> Iterator[str]:
    """Command lines of a bash block: continuations joined, comments and prompts dropped."""
    pending = ""
    for raw in text.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = (pending + line).strip().removeprefix("$ ")
        pending = ""
        if line:
            yield line


def _click_command(words: list[str]) -> tuple[Any, int]:
    """The `unbroken` (sub)command `words` name (a click command; typer may vendor click, hence no
    isinstance checks), and how many words named it."""
    cmd: Any = typer.main.get_command(app)
    used = 0
    while hasattr(cmd, "commands") and used < len(words) and words[used] in cmd.commands:
        cmd = cmd.commands[words[used]]
        used += 1
    return (cmd if used else None), used


def expand_alternatives(line: str) -> list[str]:
    """`unbroken list | status JOB | events JOB -f` -> three commands; a real pipeline stays whole."""
    if not line.startswith("unbroken ") or " | " not in line:
        return [line]
    parts = [p.strip() for p in line.split(" | ")]
    first = shlex.split(parts[0])[1:]
    top = typer.main.get_command(app)
    group = first[:1] if first and hasattr(top.commands.get(first[0]), "commands") else []
    out = [parts[0]]
    for p in parts[1:]:
        words = shlex.split(p)
        if _click_command(words)[0] is not None:
            out.append(f"unbroken {p}")
        elif group and _click_command([*group, *words])[1] == 1 + len(words[:1]):
            out.append(f"unbroken {group[0]} {p}")
        else:
            return [line]  # not alternatives: a pipeline into another program
    return out


@dataclass
class Context:
    served: Served
    job: str | None = None  # the job the README's commands submitted
    spare: str | None = None  # the one cancel and delete act on
    outs: int = 0

    def client(self) -> Any:
        from api.client import Client

        tok = json.loads((self.served.home / "token").read_text())["token"]
        return Client(self.served.url, tok)

    def main_job(self) -> str:
        if self.job is None:  # no submit line ran before: the newest finished job, else one of our own
            with self.client() as c:
                done = c.list(status=["SUCCEEDED"], limit=1).items
                if done:
                    self.job = done[0].id
                else:
                    self.job = c.submit(str(self.served.work / "job.yaml")).id
                    c.wait(self.job, timeout=COMMAND_TIMEOUT_S, raise_on_failure=False)
        return self.job

    def victim(self, *, finished: bool) -> str:
        """A job of its own for cancel and delete: submitted for cancel; for delete, once it ended
        (cancelled here if no cancel line did it)."""
        with self.client() as c:
            if self.spare is None:
                self.spare = c.submit(str(self.served.work / "job.yaml")).id
            if finished:
                if not c.get(self.spare).terminal:
                    c.cancel(self.spare)
                c.wait(self.spare, timeout=120, raise_on_failure=False)
            return self.spare

    def paths(self) -> tuple[Path, str]:
        """The main job's output folder and checkpoint root, as the scheduler resolves them."""
        from service.job_paths import resolve_job_paths
        from service.spec import load_spec_file

        spec = resolve_job_paths(load_spec_file(self.served.work / "job.yaml"), self.main_job(),
                                 self.served.home / "runs")
        out = Path(str(spec.training.output_dir))
        return out, spec.checkpoint.uri or str(out / "checkpoints")

    def fill(self, cmd: str) -> str:
        """Placeholders filled in (see the module docstring); an unknown one is left for the failure."""
        cmd = re.sub(r"\s*\[[^\]]*\]", "", cmd)
        cmd = cmd.replace("127.0.0.1:8420", f"127.0.0.1:{self.served.port}").replace(
            "localhost:8420", f"127.0.0.1:{self.served.port}")
        cmd = cmd.replace("~/.unbroken/", f"{self.served.home}/")
        words = shlex.split(cmd)
        verb = _click_command(words[1:])[0] if words[:1] == ["unbroken"] else None
        if re.search(r"\bJOB\b", cmd):
            name = verb.name if verb is not None else ""
            job = self.victim(finished=name == "delete") if name in ("cancel", "delete") else self.main_job()
            cmd = re.sub(r"\bJOB\b", job, cmd)
        if re.search(r"\b(RUN_DIR|URI)\b|s3://bucket\S*", cmd):
            out, uri = self.paths()
            cmd = re.sub(r"\bRUN_DIR\b", str(out), cmd)
            cmd = re.sub(r"\bURI\b|s3://bucket\S*", uri, cmd)
        while re.search(r"\bOUT_DIR\b", cmd):
            self.outs += 1
            cmd = re.sub(r"\bOUT_DIR\b", str(self.served.work / f"out-{self.outs}"), cmd, count=1)
        return cmd


def parse_only(cmd: str) -> str | None:
    """Parse an `unbroken` command line with its own parser, running nothing; the error, or None."""
    words = shlex.split(cmd)[1:]
    cur, used = _click_command(words)
    if cur is None:
        return f"no such command: unbroken {' '.join(words[:1])}"
    try:
        cur.make_context(" ".join(["unbroken", *words[:used]]), words[used:])
    except Exception as e:  # click's errors (maybe typer's vendored click): UsageError, BadParameter, Exit
        if type(e).__name__ == "Exit":
            return None
        if hasattr(e, "format_message"):
            return str(e.format_message())
        raise
    return None


def test_shell_commands_run(served: Served) -> None:
    ctx = Context(served)
    lines = [(b, line) for b in readme_blocks() if b.lang in ("bash", "sh", "shell", "console")
             for line in shell_lines(b.text)]
    assert lines, "README.md has no bash block"
    ran, failed, skipped = [], [], []
    for b, line in lines:
        if line.startswith("make "):
            skipped.append(f"{line} (the demo and the suite themselves)")
            continue
        for cmd in expand_alternatives(line):
            words = shlex.split(cmd)
            verb = _click_command(words[1:])[0] if words[:1] == ["unbroken"] else None
            if verb is not None and (verb.name == "serve" or verb.name in LOCAL_ENGINE_COMMANDS):
                error = parse_only(ctx.fill(cmd))
                (failed.append(f"{b.where()}: {cmd}: does not parse: {error}") if error
                 else skipped.append(f"{cmd} (parsed only)"))
                continue
            try:
                full = ctx.fill(cmd)
            except Exception as e:  # noqa: BLE001 - reported with the command
                failed.append(f"{b.where()}: {cmd}: cannot fill in its placeholders: {type(e).__name__}: {e}")
                continue
            leftover = sorted(set(re.findall(r"(?<![$\w{])[A-Z][A-Z0-9_]{2,}\b", full)))
            if leftover:
                failed.append(f"{b.where()}: {cmd}: placeholder(s) {leftover} unknown to tests/test_readme.py")
                continue
            t0 = time.monotonic()
            try:
                out = subprocess.run(["bash", "-c", full], cwd=served.work, env=served.env(), capture_output=True,
                                     text=True, timeout=COMMAND_TIMEOUT_S)
            except subprocess.TimeoutExpired as e:
                failed.append(f"{b.where()}: {full}: ran past {COMMAND_TIMEOUT_S} s: {str(e.stdout)[-800:]}")
                continue
            ran.append(f"{full}  ({time.monotonic() - t0:.1f} s, exit {out.returncode})")
            if out.returncode != 0:
                failed.append(f"{b.where()}: {full}: exit {out.returncode}\n{out.stdout[-1500:]}\n{out.stderr[-2000:]}")
            elif verb is not None and verb.name == "submit" and ctx.job is None:
                ctx.job = out.stdout.split()[0]
    print("ran:\n  " + "\n  ".join(ran) + "\nskipped:\n  " + "\n  ".join(skipped))
    assert ran, "no README command ran"
    assert not failed, "README commands that fail:\n\n" + "\n\n".join(failed) + served.tail()
