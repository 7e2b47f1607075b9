"""Launch N ranks of `python -m tests.checkpointing.<module>` as plain processes, wait, and clean up.

Our own tiny launcher (not torchrun/mp.spawn): every rank gets RANK/WORLD_SIZE/MASTER_PORT and
OMP_NUM_THREADS=1; on timeout or failure each rank we started is killed by its PID.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from workers.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def run_ranks(
    module: str, world: int, args: list[str], env: dict[str, str], timeout_s: float, log_dir: Path
) -> None:
    """Run `world` ranks; raise AssertionError with every failing rank's log tail."""
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        for r in range(world):
            log = log_dir / f"rank{r}.log"
            renv = {**os.environ, **env, "RANK": str(r), "WORLD_SIZE": str(world), "MASTER_PORT": str(port),
                    "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}  # fmt: skip
            with open(log, "wb") as f:
                p = subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, env=renv,
                                     stdout=f, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
            procs.append((p, log))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(p.poll() is None for p, _ in procs):
            if any(p.poll() not in (None, 0) for p, _ in procs):
                time.sleep(2.0)  # let the others print their side, then stop them
                break
            time.sleep(0.2)
        failed = [(r, p, log) for r, (p, log) in enumerate(procs) if p.poll() != 0]
        if failed:
            tails = []
            for r, p, log in failed:
                tail = log.read_text(errors="replace")[-3000:]
                tails.append(f"--- rank {r} (exit {p.poll()}) ---\n{tail}")
            raise AssertionError(f"{module} failed on {len(failed)} rank(s):\n" + "\n".join(tails))
    finally:
        for p, _ in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
