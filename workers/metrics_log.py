"""`metrics.jsonl`: one JSON line per training step, beside a run's checkpoints.

The same line format is written by the local launcher and the service, so tools (the API,
the demo's loss chart, benchmarks) read any run the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"

# The fields every line carries, in this order.
FIELDS: tuple[str, ...] = (
    "step", "loss", "tokens", "dp", "world_size", "generation",
    "step_time_s", "tokens_per_s", "lr", "grad_norm",
)


def metrics_line(metrics: Any, *, generation: int = 0) -> dict[str, Any]:
    """A metrics line from a `parallel.trainer.StepMetrics` (or a dict with its fields)."""
    get = metrics.get if isinstance(metrics, dict) else lambda k, d=None: getattr(metrics, k, d)
    line: dict[str, Any] = {k: get(k) for k in FIELDS if k != "generation"}
    line["generation"] = generation
    line = {k: line[k] for k in FIELDS}
    peak = get("peak_mem_bytes")
    if peak is not None:
        line["peak_mem_bytes"] = peak
    for key in ("mfu", "eval_loss", "eval_ppl"):  # only where there is a value (eval: the steps it ran)
        value = get(key)
        if value is not None:
            line[key] = value
    return line


class MetricsLog:
    """Appends one line per step, flushed at once so a crash loses nothing already reported."""

    def __init__(self, path: str | Path, *, truncate: bool = True) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("w" if truncate else "a", encoding="utf-8")

    def write(self, line: dict[str, Any]) -> None:
        self._f.write(json.dumps(line, separators=(",", ":")) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All complete lines of a metrics file (a torn last line from a crash is skipped)."""
    p = Path(path)
    if p.is_dir():
        p = p / METRICS_FILE
    out = []
    for raw in p.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(raw))
        except json.JSONDecodeError:
            continue
    return out
