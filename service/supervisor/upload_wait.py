"""A resize held while a persistent checkpoint uploads, so the upload does not sit inside the pause.

A rank told to pause finishes the save in flight before it leaves (its last collective is on the
generation's side group), so a grow or shrink asked during an upload would pause training for the rest
of that upload. The supervisor asks for the pause only once the ranks' heartbeats say no save is
uploading, and not for a step at or after one a save starts at; training goes on meanwhile, for at most
UPLOAD_WAIT_S (uploads back to back leave no gap), then the pause is asked regardless.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("unbroken.supervisor")

UPLOAD_WAIT_S = 60.0


def upload_in_the_way(persist_every: int, in_memory_every: int, uploading: list[int], seen: int,
                      target: int) -> int | None:
    """The persistent save a pause after step `target` (the ranks seen at step `seen`) would wait for,
    or None: a save uploading now, or, where the restore comes from the keepers (in_memory_every > 0)
    and the saves leave steps between them, one that starts at a step up to `target`. Without snapshots
    the pause is at a save's step on purpose: the next generation restores that save."""
    if uploading:
        return max(uploading)
    starts = (target // persist_every) * persist_every if persist_every else 0
    if in_memory_every > 0 and persist_every > target - seen and starts > seen:
        return starts
    return None


class UploadWait:
    """One job's wait: `holds` says whether a resize asked now should wait, and times the wait."""

    def __init__(self, job_id: str, persist_every: int, in_memory_every: int) -> None:
        self.job_id = job_id
        self.persist_every = persist_every
        self.in_memory_every = in_memory_every
        self._seen: tuple[int, float] | None = None  # (step, when) of the save being waited for

    def holds(self, beats: list[Any], seen: int, target: int, why: str) -> bool:
        """Whether a pause after `target` waits (`upload_in_the_way`, from the generation's heartbeats),
        up to UPLOAD_WAIT_S from when the wait began."""
        uploading = [int(m.uploading) for m in beats if getattr(m, "uploading", None) is not None]
        step = upload_in_the_way(self.persist_every, self.in_memory_every, uploading, seen, target)
        if step is None:
            self._seen = None
            return False
        now = time.monotonic()
        if self._seen is None:
            self._seen = (step, now)
            log.info("job %s: %s after the checkpoint of step %d is uploaded", self.job_id, why, step)
        return now - self._seen[1] < UPLOAD_WAIT_S
