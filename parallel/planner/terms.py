"""One itemised quantity of an estimate, with the formula that gave it and its numbers filled in.

Every memory item and time item the planner reports is a `Term`, so `--explain` can show how
each number was reached without a second, drifting copy of the arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Term:
    name: str
    value: float  # bytes for memory terms, seconds for time terms
    formula: str  # symbolic, e.g. "12·Ψ/N_shard"
    filled: str  # the same with numbers, e.g. "12 × 8.03e9 / 8"

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "value": self.value, "formula": self.formula, "filled": self.filled}


def fmt_bytes(n: float) -> str:
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_time(s: float) -> str:
    if s < 0:
        return "−" + fmt_time(-s)
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"


def g(x: float) -> str:
    """A number as the formulas print it: integers plainly, others in 3 significant digits."""
    if float(x).is_integer() and abs(x) < 1e7:
        return str(int(x))
    return f"{x:.3g}"


def total(terms: list[Term]) -> float:
    return sum(t.value for t in terms)
