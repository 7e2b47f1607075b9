"""The process-group timeout of a generation: a rule the supervisor applies before every launch.

Torch-free on purpose: the supervisor never imports torch, and importing it here (through
workers.group) cost about 1 s on every job's start path, before its first launch."""

from __future__ import annotations

# A step may take this many times the slowest step seen before its collectives time out.
TIMEOUT_STEP_FACTOR = 20.0


def collective_timeout_s(floor_s: float, max_step_time_s: float | None) -> float:
    """The process-group timeout: the floor, or TIMEOUT_STEP_FACTOR x the slowest step if longer."""
    if max_step_time_s is None or max_step_time_s <= 0:
        return floor_s
    return max(floor_s, TIMEOUT_STEP_FACTOR * max_step_time_s)
