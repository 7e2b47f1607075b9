"""How counts read in the sentences users see (events, the goodput line): one rule, free of Ray and torch."""

from __future__ import annotations


def plural(n: int, word: str) -> str:
    """`n word`, with an s unless n is 1: "1 worker", "3 workers", "0 steps"."""
    return f"{n} {word}" + ("" if n == 1 else "s")
