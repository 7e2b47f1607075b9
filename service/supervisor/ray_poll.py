"""The watch loop's look at answers it asked for earlier: which refs are in, without waiting."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def ready_now(refs: Iterable[Any]) -> set[Any]:
    """The refs among `refs` whose results are in (a value, or the error of a task or actor that failed);
    never blocks. The supervisor's loop polls its pings and warm-ups so that one slow actor never holds
    up detection."""
    refs = list(refs)
    if not refs:
        return set()
    import ray

    return set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
