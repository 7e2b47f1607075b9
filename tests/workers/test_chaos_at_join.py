"""A chaos fault `at: join` fires as its generation's group connects, in the worker that holds its rank
there, and nowhere else: not before a step, not in another generation or rank (real processes: the
fault kills the one it fires in)."""

from __future__ import annotations

import multiprocessing as mp
import signal
from pathlib import Path

from workers.chaos import Chaos, fault_place


def _worker(out: str, calls: list[tuple[str, int, int, int]]) -> None:
    fired = Path(out)
    chaos = Chaos([{"kind": "sigkill_worker", "at": "join", "rank": 1, "generation": 1},
                   {"kind": "kill_worker", "step": 0, "rank": 2, "generation": 0}],
                  is_head_node=lambda: True, on_fire=lambda f: fired.write_text(f"{f.kind} {fault_place(f.at, f.step)}"))
    for what, steps, rank, gen in calls:
        if what == "step":
            chaos.before_step(steps, rank, gen)
        else:
            chaos.as_group_connects(rank, gen)
    fired.write_text(fired.read_text() + " survived" if fired.exists() else "survived")


def _run(tmp: Path, calls: list[tuple[str, int, int, int]]) -> tuple[int | None, str]:
    out = tmp / f"out-{len(list(tmp.iterdir()))}"
    p = mp.get_context("spawn").Process(target=_worker, args=(str(out), calls))
    p.start()
    p.join(60)
    return p.exitcode, out.read_text() if out.exists() else ""


def test_a_join_fault_fires_only_as_its_generations_group_connects(tmp_path: Path) -> None:
    # Its rank before every step of generation 1, its rank connecting generation 0, another rank connecting
    # generation 1: nothing fires.
    quiet = [("step", 0, 1, 1), ("step", 1, 1, 1), ("join", 0, 1, 0), ("join", 0, 0, 1), ("join", 0, 3, 1)]
    assert _run(tmp_path, quiet) == (0, "survived")
    # Rank 1 connecting generation 1: the note first (the supervisor names the cause), then the SIGKILL.
    code, text = _run(tmp_path, [*quiet, ("join", 0, 1, 1)])
    assert (code, text) == (-signal.SIGKILL, "sigkill_worker as its group connects"), (code, text)
    # A step fault is not fired by a join, nor a join fault by a step.
    assert _run(tmp_path, [("join", 0, 2, 0)]) == (0, "survived")
    code, text = _run(tmp_path, [("step", 0, 2, 0)])
    assert (code, text) == (1, "kill_worker before step 1"), (code, text)
