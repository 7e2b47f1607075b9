"""The supervisor's sentences: how failures, restores and durations read in events."""

from __future__ import annotations

from typing import Any

from service.policies import FailureKind

SOURCE_WORDS = {"keepers": "from memory", "memory": "from memory", "persistent": "from the persistent checkpoint",
                "fresh": "from scratch", "resume_from": "from checkpoint.resume_from",
                "peer": "from a live replica"}


def first_line(e: Any) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def fmt_s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}s"


def cause_phrase(kind: str, ranks: list[int]) -> str:
    """A failure in a few words, for the `recovered` sentence."""
    ranks = sorted({r for r in ranks if r >= 0})
    who = (("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))) if ranks else "a broken collective"
    return {
        FailureKind.WORKER_DIED: f"the loss of {who}", FailureKind.NODE_DIED: f"the loss of a node ({who})",
        FailureKind.HANG: f"a hang of {who}", FailureKind.STEP_ERROR: f"an error in the step of {who}",
        FailureKind.STRAGGLER: f"replacing the straggler {who}", FailureKind.COLLECTIVE_ERROR: "a broken collective",
    }.get(kind, f"{kind} ({who})")  # type: ignore[call-overload]


def restore_phrase(target: dict[str, Any] | None) -> str:
    """How a generation starts, in words (the restore target the workers get)."""
    if target is None:
        return ", from scratch"
    if target.get("step") is not None:
        return f", restoring the in-memory snapshot of step {target['step']}"
    if target.get("resume"):
        return ", from the job's newest persistent checkpoint if it has one"
    return ", from the newest persistent checkpoint (no in-memory snapshot is committed)"
