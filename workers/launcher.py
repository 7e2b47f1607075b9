"""The local launcher: one machine, N rank processes, no Ray, no torchrun.

Each rank is `python -m workers.rank_main` started with subprocess.Popen and the usual
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, MASTER_PORT=a free port);
rank 0 hosts the TCPStore. Unlike torchrun/mp.spawn we own the processes: when one rank
dies we stop the others by PID and say which rank failed and why (its stderr tail).

Rank 0 reports each step through a pipe; the launcher writes `metrics.jsonl`, shows progress,
and rank 0 saves `final/` (full weights + config) at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parallel.config import EngineConfig, resolve_local_paths
from workers.final_state import FINAL_DIR
from workers.metrics_log import METRICS_FILE, MetricsLog
from workers.ports import free_port
from workers.progress import StepProgress
from workers.rank_main import DEVICE_ENV, LAUNCH_TIME_ENV, REPORT_FD_ENV, error_file

_REPO_ROOT = Path(__file__).resolve().parents[1]
_STOP_GRACE_S = 5.0


class LaunchConfigError(ValueError):
    """A job that cannot run at this world size; raised before any process starts."""


class RankFailure(RuntimeError):
    """A rank exited non-zero (or was killed); the others were stopped."""

    def __init__(
        self, rank: int, returncode: int, stderr_tail: str, others: dict[int, int | None], error: str | None = None
    ) -> None:
        self.rank, self.returncode, self.stderr_tail, self.others = rank, returncode, stderr_tail, others
        self.error = error
        how = f"was killed by {signal.Signals(-returncode).name}" if returncode < 0 else f"exited with {returncode}"
        msg = f"rank {rank} failed first ({error})" if error else f"rank {rank} failed first: it {how}"
        msg += "; stopped the other ranks"
        if others:
            msg += " (" + ", ".join(f"rank {r}: {_describe_rc(rc)}" for r, rc in sorted(others.items())) + ")"
        if stderr_tail.strip():
            msg += f"\n--- rank {rank} stderr (last lines) ---\n{stderr_tail.rstrip()}"
        super().__init__(msg)


def _describe_rc(rc: int | None) -> str:
    if rc is None:
        return "stopped"
    if rc < 0:
        return f"stopped by {signal.Signals(-rc).name}"
    return f"exit {rc}"


@dataclass
class LaunchResult:
    output_dir: Path
    metrics_path: Path
    final_dir: Path | None
    steps: int                     # step lines written to metrics.jsonl
    last: dict[str, Any] | None    # the last metrics line
    wall_s: float                  # from the first process start to the last exit
    setup_s: float | None          # rank 0: process start to the trainer ready (import, group, build)
    pids: list[int] = field(default_factory=list)


def resolve_device(device: str | None) -> str:
    """'cpu' or 'cuda'; None/'auto' picks CUDA when present."""
    if device in (None, "auto"):
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise LaunchConfigError(f"device={device!r}: use cpu, cuda or auto")
    return device


def check_job(cfg: EngineConfig, nproc: int, device: str = "cpu") -> None:
    """Everything about the job that can be checked before a process starts; raises LaunchConfigError."""
    from parallel.dims import ParallelDims, ParallelDimsError

    if nproc < 1:
        raise LaunchConfigError(f"--nproc={nproc}: run at least one process")
    errors: list[str] = []
    try:
        dims = ParallelDims.from_config(cfg.parallelism, nproc)
        dims.validate(cfg.model, cfg.training, cfg.parallelism)
    except ParallelDimsError as e:
        errors.append(f"parallelism (world size {nproc}): {e}")
    if cfg.data.kind != "synthetic" and cfg.data.path and not Path(cfg.data.path).exists():
        errors.append(f"data.path: {cfg.data.path!r} does not exist; point it at a file or folder")
    if cfg.model.init_from and not (Path(cfg.model.init_from) / "config.json").is_file():
        errors.append(
            f"model.init_from: {cfg.model.init_from!r} is not a Hugging Face model folder (no config.json); "
            f"point it at an `unbroken export-hf` output"
        )
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < nproc:
            errors.append(f"--nproc={nproc} exceeds the {torch.cuda.device_count()} visible GPUs; lower --nproc")
    if errors:
        raise LaunchConfigError("\n".join(errors))


def exited_rc(proc: subprocess.Popen[bytes]) -> int:
    """The exit code of a process known to have exited (0 if it is somehow still running)."""
    rc = proc.poll()
    return 0 if rc is None else rc


def _read_error(path: Path) -> tuple[float, str] | None:
    """(time, message) a rank recorded as it failed, if it could."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return float(data["time"]), str(data["error"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class LocalLauncher:
    """Start the ranks, follow rank 0's reports, stop everyone if one fails.

    `on_event(launcher, event)` is called in the launcher's thread for every report of rank 0
    (event["event"] in start/step/final), e.g. to inject a fault by PID in a test.
    """

    def __init__(
        self,
        cfg: EngineConfig,
        nproc: int,
        output_dir: str | Path | None = None,
        *,
        device: str | None = "auto",
        env: dict[str, str] | None = None,
        show_progress: bool = True,
        on_event: Callable[[LocalLauncher, dict[str, Any]], None] | None = None,
    ) -> None:
        self.device = resolve_device(device)
        check_job(cfg, nproc, self.device)
        self.cfg = cfg.model_copy(deep=True)
        self.nproc = nproc
        named = output_dir if output_dir is not None else cfg.training.output_dir
        # A fresh folder for each run unless one is named: a run never reads or overwrites another's.
        self.output_dir = Path(named or Path("runs") / time.strftime("train-%Y%m%d-%H%M%S")).resolve()
        self.cfg.training.output_dir = str(self.output_dir)
        # Paths as the caller meant them (relative to its folder), whatever folder a rank reads them in.
        resolve_local_paths(self.cfg.model, self.cfg.data)
        self.extra_env = dict(env or {})
        self.show_progress = show_progress
        self.on_event = on_event
        self.procs: list[subprocess.Popen[bytes]] = []
        self._events: queue.Queue[tuple[str, Any]] = queue.Queue()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # --- processes -----------------------------------------------------------------------
    def _rank_env(self, rank: int, port: int) -> dict[str, str]:
        env = {**os.environ, **self.extra_env}
        env.update(
            RANK=str(rank), WORLD_SIZE=str(self.nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(self.nproc),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1",
        )
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO_ROOT), env.get("PYTHONPATH")) if p)
        if self.device == "cpu":
            # Ranks share the cores: one intra-op thread each unless the caller says otherwise.
            env.setdefault("OMP_NUM_THREADS", "1")
            env[DEVICE_ENV] = "cpu"
        else:
            env[DEVICE_ENV] = f"cuda:{rank}"  # CUDA_VISIBLE_DEVICES passes through; LOCAL_RANK picks one
        return env

    def start(self) -> None:
        if self.procs:
            raise RuntimeError("this launcher already started its ranks")
        logs = self.output_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        # A reused run folder: what an earlier run left must not pass for this run's result.
        for stale in logs.glob("rank*.error.json"):
            stale.unlink()
        shutil.rmtree(self.output_dir / FINAL_DIR, ignore_errors=True)
        job_file = self.output_dir / "job.json"
        job_file.write_text(self.cfg.model_dump_json(indent=2) + "\n", encoding="utf-8")
        port = free_port()
        launch_time = str(time.time())
        read_fd, write_fd = os.pipe()
        try:
            for rank in range(self.nproc):
                env = self._rank_env(rank, port)
                env[LAUNCH_TIME_ENV] = launch_time
                pass_fds: tuple[int, ...] = ()
                if rank == 0:
                    env[REPORT_FD_ENV] = str(write_fd)
                    pass_fds = (write_fd,)
                with (logs / f"rank{rank}.stdout").open("wb") as out, (logs / f"rank{rank}.stderr").open("wb") as err:
                    # Own session: a Ctrl-C at the terminal reaches the launcher only, which stops the ranks.
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "workers.rank_main", "--config", str(job_file),
                         "--output", str(self.output_dir)],
                        env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                        pass_fds=pass_fds, start_new_session=True,
                    )
                self.procs.append(proc)
        except BaseException:
            os.close(read_fd)
            self.stop()
            raise
        finally:
            os.close(write_fd)  # only rank 0 holds the write end now: EOF when it exits
        threading.Thread(target=self._read_reports, args=(read_fd,), daemon=True).start()
        for rank, proc in enumerate(self.procs):
            threading.Thread(target=self._wait_rank, args=(rank, proc), daemon=True).start()

    def _read_reports(self, fd: int) -> None:
        with os.fdopen(fd, "r", encoding="utf-8") as f:
            for raw in f:
                try:
                    self._events.put(("report", json.loads(raw)))
                except json.JSONDecodeError:
                    continue
        self._events.put(("eof", None))

    def _wait_rank(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        rc = proc.wait()
        self._events.put(("exit", (rank, rc, time.time())))

    def stop(self) -> dict[int, int | None]:
        """SIGTERM every live rank by PID, SIGKILL after a grace period; returns their exit codes."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _STOP_GRACE_S
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return {r: p.returncode for r, p in enumerate(self.procs)}

    # --- the run -----------------------------------------------------------------------------
    def run(self) -> LaunchResult:
        """Start, follow to the end, and return the result; raises RankFailure if a rank fails."""
        t0 = time.perf_counter()
        self.start()
        self._metrics_path = self.output_dir / METRICS_FILE
        self._steps, self._last, self._final_dir, self._setup_s = 0, None, None, None
        exited: dict[int, int] = {}
        reports_done = False
        try:
            with MetricsLog(self._metrics_path) as log, StepProgress(
                self.cfg.training.steps, enabled=self.show_progress
            ) as progress:
                # Until every rank has exited and rank 0's report pipe is closed (its last lines read).
                while len(exited) < self.nproc or not reports_done:
                    try:
                        kind, payload = self._events.get(timeout=None if len(exited) < self.nproc else _STOP_GRACE_S)
                    except queue.Empty:
                        break  # all exited but the pipe stays open (a leaked child holds it): stop waiting
                    if kind == "exit":
                        rank, rc, when = payload
                        exited[rank] = rc
                        if rc != 0:
                            self._fail(rank, rc, when, log, progress)
                    elif kind == "eof":
                        reports_done = True
                    else:
                        self._handle_report(payload, log, progress)
        except BaseException:
            self.stop()
            raise
        return LaunchResult(
            output_dir=self.output_dir, metrics_path=self._metrics_path, final_dir=self._final_dir,
            steps=self._steps, last=self._last, wall_s=time.perf_counter() - t0, setup_s=self._setup_s,
            pids=self.pids,
        )

    def _fail(self, rank: int, rc: int, when: float, log: MetricsLog, progress: StepProgress) -> None:
        """A rank exited non-zero: stop the rest, find the rank that failed first, raise."""
        stopped_at = time.time()
        codes = self.stop()
        self._drain_reports(log, progress)
        # When one rank fails its peers fail too (their collectives break). The culprit is the rank
        # whose failure came first: by the error time it recorded before leaving the group, else
        # (killed, no chance to record) by when its exit was seen.
        first: dict[int, float] = {rank: when}
        # A rank killed by a signal before we stopped anyone could record nothing: it is the cause,
        # even if a peer's "connection reset" error was written before its exit was seen.
        signaled: dict[int, float] = {rank: when} if rc < 0 else {}
        while True:
            try:
                kind, payload = self._events.get_nowait()
            except queue.Empty:
                break
            if kind == "exit" and payload[1] != 0 and payload[2] <= stopped_at:
                first[payload[0]] = payload[2]
                if payload[1] < 0:
                    signaled[payload[0]] = payload[2]
        errors = {r: e for r in range(self.nproc) if (e := _read_error(error_file(self.output_dir, r))) is not None}
        for r, (t, _) in errors.items():
            if t <= stopped_at:
                first[r] = min(first.get(r, t), t)
        culprit = min(signaled or first, key=lambda r: (signaled or first)[r])
        others = {r: c for r, c in codes.items() if r != culprit}
        raise RankFailure(
            culprit, codes[culprit] if codes[culprit] is not None else -signal.SIGKILL,
            _tail(self.output_dir / "logs" / f"rank{culprit}.stderr"), others,
            error=errors[culprit][1] if culprit in errors else None,
        )

    def _handle_report(self, event: dict[str, Any], log: MetricsLog, progress: StepProgress) -> None:
        if event["event"] == "step":
            line = {k: v for k, v in event.items() if k != "event"}
            log.write(line)
            progress.update(line)
            self._steps, self._last = self._steps + 1, line
        elif event["event"] == "start":
            self._setup_s = event.get("setup_s")
        elif event["event"] == "final":
            self._final_dir = Path(event["path"])
        if self.on_event is not None:
            self.on_event(self, event)

    def _drain_reports(self, log: MetricsLog, progress: StepProgress) -> None:
        """After a failure: keep the step lines rank 0 sent before it stopped; they are true steps."""
        deadline = time.monotonic() + _STOP_GRACE_S
        while time.monotonic() < deadline:
            try:
                kind, payload = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return
            if kind == "eof":
                return
            if kind == "report" and payload.get("event") == "step":
                self._handle_report(payload, log, progress)


def run_local(
    cfg: EngineConfig,
    nproc: int,
    output_dir: str | Path | None = None,
    **kwargs: Any,
) -> LaunchResult:
    """Validate, launch `nproc` ranks on this machine, wait; see LocalLauncher for the options."""
    return LocalLauncher(cfg, nproc, output_dir, **kwargs).run()


__all__ = [
    "LaunchConfigError", "LaunchResult", "LocalLauncher", "RankFailure", "check_job", "run_local",
]
