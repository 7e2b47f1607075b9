"""The launcher's progress display: a rich bar on a terminal, a few plain lines elsewhere."""

from __future__ import annotations

import sys
from typing import Any, TextIO


class StepProgress:
    """Shows steps done, the latest loss (and eval loss, once evaluated) and tokens/s from rank 0's reports."""

    def __init__(self, total_steps: int, *, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.total = total_steps
        self.enabled = enabled
        self._stream = stream or sys.stderr
        self._progress: Any = None
        self._task: Any = None
        self._plain_every = max(1, total_steps // 10)
        self._eval = "-"

    def __enter__(self) -> StepProgress:
        if not self.enabled:
            return self
        from rich.console import Console

        console = Console(file=self._stream)
        if console.is_terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("eval {task.fields[eval]}"),
                TextColumn("{task.fields[tps]} tok/s"),
                TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=self.total, loss="-", eval="-", tps="-")
        return self

    def update(self, line: dict[str, Any]) -> None:
        if not self.enabled:
            return
        loss, tps, step = f"{line['loss']:.4f}", f"{line['tokens_per_s']:,.0f}", int(line["step"])
        evaluated = line.get("eval_loss") is not None
        if evaluated:
            self._eval = f"{line['eval_loss']:.4f}"
        if self._progress is not None:
            self._progress.update(self._task, completed=step, loss=loss, eval=self._eval, tps=tps)
        elif step % self._plain_every == 0 or step == self.total or step == 1 or evaluated:
            ev = f"  eval {self._eval}" if evaluated else ""
            print(f"step {step}/{self.total}  loss {loss}{ev}  {tps} tok/s", file=self._stream, flush=True)

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
