"""One rank of a local run: `python -m workers.rank_main --config JOB.json --output DIR`.

Started by `workers.launcher` with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT
in the environment. Rank 0 hosts the TCPStore. Rank 0 writes one JSON line per event to the
file descriptor in UNBROKEN_REPORT_FD (start, each step, final), which the launcher reads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from workers.protocol import RunStatus
from workers.train_loop import LoopHooks

REPORT_FD_ENV = "UNBROKEN_REPORT_FD"
FAIL_AT_ENV = "UNBROKEN_FAIL_AT"  # fault injection: "RANK:STEP" raises in that rank before that step
DEVICE_ENV = "UNBROKEN_DEVICE"
TIMEOUT_ENV = "UNBROKEN_COLLECTIVE_TIMEOUT_S"
LAUNCH_TIME_ENV = "UNBROKEN_LAUNCH_TIME"  # wall clock when the launcher started the ranks


class Reporter:
    """JSON lines to the launcher through an inherited pipe; a no-op where there is none."""

    def __init__(self, fd: int | None) -> None:
        self._f = os.fdopen(fd, "w", buffering=1, encoding="utf-8") if fd is not None else None

    def send(self, event: str, **fields: Any) -> None:
        if self._f is not None:
            self._f.write(json.dumps({"event": event, **fields}, separators=(",", ":")) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


def error_file(output: str | Path, rank: int) -> Path:
    return Path(output) / "logs" / f"rank{rank}.error.json"


def _record_error(output: str, rank: int, exc: BaseException) -> None:
    """Written before the group is torn down, so the first rank to fail has the earliest time:
    the launcher tells the culprit from peers that failed only because it went away."""
    with contextlib.suppress(OSError):
        error_file(output, rank).write_text(
            json.dumps({"time": time.time(), "error": f"{type(exc).__name__}: {exc}"[:2000]}), encoding="utf-8"
        )


def _fail_at() -> tuple[int, int] | None:
    spec = os.environ.get(FAIL_AT_ENV)
    if not spec:
        return None
    rank, step = spec.split(":")
    return int(rank), int(step)


class _LauncherHooks(LoopHooks):
    """A launched rank's part of the train loop: fault injection before a step, a report line after."""

    def __init__(self, reporter: Reporter, rank: int, fail_at: tuple[int, int] | None) -> None:
        self.reporter, self.rank, self.fail_at = reporter, rank, fail_at

    def before_step(self, done: int) -> None:
        if self.fail_at == (self.rank, done + 1):
            raise RuntimeError(f"injected fault ({FAIL_AT_ENV}) in rank {self.rank} before step {done + 1}")

    def after_step(self, metrics: Any, gap_s: float) -> RunStatus | None:
        from workers.metrics_log import metrics_line

        self.reporter.send("step", **metrics_line(metrics))
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="the resolved EngineConfig as JSON")
    parser.add_argument("--output", required=True, help="the run's output folder")
    args = parser.parse_args(argv)

    import torch

    from parallel import dist as pdist
    from parallel.config import EngineConfig
    from parallel.trainer import Trainer
    from workers.train_loop import train

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    cfg = EngineConfig.model_validate_json(Path(args.config).read_text(encoding="utf-8"))
    cfg.training.output_dir = args.output
    device = torch.device(os.environ[DEVICE_ENV]) if os.environ.get(DEVICE_ENV) else pdist.default_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    fd = os.environ.get(REPORT_FD_ENV)
    reporter = Reporter(int(fd) if fd and rank == 0 else None)
    t0 = time.perf_counter()
    try:
        if world > 1:
            timeout = float(os.environ.get(TIMEOUT_ENV, "120"))
            store = pdist.make_store(
                os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]), world,
                is_master=rank == 0, timeout_s=timeout,
            )
            pdist.init_process_group(rank, world, store, device=device, timeout_s=timeout)
        trainer = Trainer(cfg, device=device)
        launched = float(os.environ.get(LAUNCH_TIME_ENV, "0")) or None
        setup_s = time.time() - launched if launched else time.perf_counter() - t0
        reporter.send("start", dp=trainer.dims.dp, world_size=world, setup_s=setup_s,
                      step=trainer.step, total_steps=cfg.training.steps)
        end = train(trainer, cfg, rank, args.output, _LauncherHooks(reporter, rank, _fail_at()))
        if end.final is not None:
            reporter.send("final", path=end.final)
    except BaseException as e:
        _record_error(args.output, rank, e)
        raise
    finally:
        pdist.destroy_process_group()
        reporter.close()
    return 0


if __name__ == "__main__":
    code = main()
    # The rank's work and reports are done: skip the interpreter's teardown, where a native thread left
    # by torch/gloo once aborted a finished rank ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
