"""What live workers kept that the supervisor's record lacks: their newest metrics rows
(Worker.rows_after) and output lines (Worker.lines_after). A supervisor that adopts a job after its
own restart takes both; a recovery takes its survivors' rows, so that its restore target can be the
newest snapshot whole on the keepers rather than the one before it.
"""

from __future__ import annotations

from typing import Any

import ray

from service.supervisor.context import JobRun
from service.supervisor.generations import Generations
from service.supervisor.pool import Slot
from service.supervisor.reporter import Reporter


def lines_from_workers(reporter: Reporter, slots: list[Slot], timeout_s: float = 10.0) -> int:
    """The output lines the adopted workers sent that the job's logs lack (lost with the crashed
    instance, or sent while none ran: Worker.lines_after), added to the logs now; how many."""
    newest = reporter.newest_log_times()
    if newest is None or not slots:
        return 0
    count = 0
    for got in _ask_workers(slots, "lines_after", newest, timeout_s=timeout_s):
        by_source: dict[str, list[tuple[float, str, str]]] = {}
        for t, stream, line, source in got:
            by_source.setdefault(source, []).append((t, stream, line))
        for source, lines in by_source.items():
            reporter.add_logs(source, lines)
        count += len(got)
    reporter.flush_logs()
    return count


def rows_from_workers(run: JobRun, reporter: Reporter, gens: Generations, slots: list[Slot],
                      timeout_s: float = 10.0) -> int:
    """The metrics rows after the last one written, from live workers (adopted, or a recovery's
    survivors: they keep their newest rows, Worker.rows_after), written now in step order; how many.
    Per step the newest generation's row is taken, rank 0's first; another rank's only without pipeline
    stages (then every rank's row is the same global loss). Only the unbroken run after the last row
    written is taken: a row is never skipped."""
    after = reporter.last_row_step
    if not slots:
        return 0
    any_rank = run.spec.parallelism.pp == 1
    best: dict[int, tuple[tuple[int, bool], dict[str, Any]]] = {}
    for got in _ask_workers(slots, "rows_after", after, timeout_s=timeout_s):
        for gen, rank, row in got:
            if rank != 0 and not any_rank:
                continue
            step, key = int(row["step"]), (int(gen), rank == 0)
            if step not in best or key > best[step][0]:
                best[step] = (key, row)
    step, out = after + 1, []
    while step in best:
        out.append(best[step][1])
        step += 1
    if out:
        with run.lock:
            for row in out:
                run.pending_rows.setdefault(int(row["step"]), gens.spares.in_row(row))
        reporter.flush_metrics()
    return len(out)


def _ask_workers(slots: list[Slot], method: str, *args: Any, timeout_s: float) -> list[Any]:
    """Call `method` on every slot's worker; the answers that came within `timeout_s` (a worker lost
    meanwhile has nothing to give: the others answer for it)."""
    refs = [getattr(s.handle, method).remote(*args) for s in slots]
    if not refs:
        return []
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    answers = []
    for ref in ready:
        try:
            answers.append(ray.get(ref, timeout=1.0))
        except Exception:  # noqa: BLE001, S112 - lost meanwhile
            continue
    return answers
