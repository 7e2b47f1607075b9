"""Optional per-job TensorBoard event files: loss, eval loss, learning rate, tokens/s, grad norm, step time,
MFU, data-parallel degree and generation per step, and recoveries as text events.

One writer per job (rank 0, or the supervisor): every rank sees the same global loss. Needs the
`tensorboard` package (`pip install 'unbroken[tensorboard]'`); `torch.utils.tensorboard` imports
it on first use, so this module costs nothing until a writer is made.

    with TensorBoardLog(run_dir / "tensorboard") as tb:
        tb.log_step(metrics, dp=4, generation=0)

`write_from_metrics_file` turns an existing run's metrics.jsonl into event files afterwards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workers.metrics_log import read_metrics

# metrics field -> TensorBoard tag
SCALARS: dict[str, str] = {
    "loss": "train/loss",
    "eval_loss": "eval/loss",
    "eval_ppl": "eval/perplexity",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "step_time_s": "perf/step_time_s",
    "mfu": "perf/mfu",
    "dp": "elastic/dp_degree",
    "generation": "elastic/generation",
}


class TensorBoardUnavailable(RuntimeError):
    pass


def _writer(log_dir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # torch raises ImportError when the tensorboard package is missing
        raise TensorBoardUnavailable(
            "TensorBoard logging needs the tensorboard package: pip install 'unbroken[tensorboard]' "
            "(or turn the job's TensorBoard logging off)"
        ) from e
    return SummaryWriter(log_dir=str(log_dir), flush_secs=10)


class TensorBoardLog:
    """Writes one job's scalars under `log_dir` (created if missing)."""

    def __init__(self, log_dir: str | Path) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._w = _writer(self.log_dir)

    def log_line(self, line: dict[str, Any]) -> None:
        """One metrics.jsonl line (workers.metrics_log.metrics_line); absent or None fields are skipped."""
        step = int(line["step"])
        for key, tag in SCALARS.items():
            v = line.get(key)
            if v is not None:
                self._w.add_scalar(tag, float(v), step)

    def log_step(self, m: Any, *, dp: int, generation: int) -> None:
        """One step from a `parallel.trainer.StepMetrics` (or anything with its fields)."""
        line = {k: getattr(m, k, None) for k in SCALARS if k not in ("dp", "generation")}
        line.update(step=m.step, dp=dp, generation=generation)
        self.log_line(line)

    def log_recovery(self, step: int, generation: int, cause: str, detail: str = "") -> None:
        """A recovery or resize, as a text event at the step where training resumed."""
        text = f"generation {generation}: {cause}" + (f" ({detail})" if detail else "")
        self._w.add_text("elastic/events", text, step)

    def flush(self) -> None:
        self._w.flush()

    def close(self) -> None:
        self._w.close()

    def __enter__(self) -> TensorBoardLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_from_metrics_file(metrics_path: str | Path, log_dir: str | Path) -> int:
    """Event files from a run's metrics.jsonl (a file, or the folder holding it); returns lines written."""
    lines = read_metrics(metrics_path)
    with TensorBoardLog(log_dir) as tb:
        for line in lines:
            tb.log_line(line)
    return len(lines)
