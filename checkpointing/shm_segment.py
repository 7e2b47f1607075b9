"""Shared-memory segments for handing a snapshot to the keeper on the rank's own node without a socket.

    seg = Segment.create(nbytes)        # worker: a /dev/shm file, its pages reserved, mapped read-write
    seg.tensor                          # a uint8 torch tensor over it (the staging buffer)
    seg.name                            # what the keeper is told
    view = open_readonly(seg.name)      # keeper: a read-only numpy view of the same pages
    seg.close()                         # worker: unlink the name (also when seg is collected)
    sweep()                             # keeper: unlink the segments of processes that are gone

Why: streaming a shard to the keeper on the same node costs a kernel copy out of the worker, TCP's
loopback work and a kernel copy into the keeper, about 19 ms of CPU for a 35 MiB shard on 2 cores
(handover_bench), taken from training on a CPU node. Through a shared segment the keeper keeps the
segment as the shard's bytes (0.3 ms), or copies it out (5 ms) when it already keeps its limit. The
copy to the other node's keeper still goes over its socket (the network, on a real cluster).

A name is `unbroken-snap-<pid>-<random>`: the pid lets a keeper unlink the segments of a worker that
died without closing them (SIGKILL), and only names of that form are ever opened or unlinked.
`posix_fallocate` reserves the pages at creation, so a full /dev/shm (a container's 64 MB default)
is an OSError here, where the caller keeps a private buffer, never a SIGBUS in the middle of a copy.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import weakref
from pathlib import Path

import numpy as np

__all__ = ["SHM_DIR", "Segment", "open_readonly", "sweep", "unlink", "valid_name"]

SHM_DIR = Path("/dev/shm")
_PREFIX = "unbroken-snap-"
_NAME = re.compile(rf"^{_PREFIX}(\d+)-[0-9a-f]{{16}}$")


def valid_name(name: str) -> bool:
    """Whether `name` is a segment name this module makes (nothing else is opened or unlinked)."""
    return bool(_NAME.match(name))


class Segment:
    """A worker's segment: created, reserved and mapped; its name is unlinked by `close()` or when the
    object is collected, whichever comes first."""

    def __init__(self, name: str, tensor: object) -> None:
        self.name = name
        self.tensor = tensor  # torch.Tensor (uint8, 1-D); typed loosely so the keeper side needs no torch
        self.close = weakref.finalize(self, unlink, name)  # runs once

    @classmethod
    def create(cls, nbytes: int) -> Segment:
        """A new segment of `nbytes` (at least 1). OSError when /dev/shm is missing or too small."""
        import torch

        nbytes = max(int(nbytes), 1)
        name = f"{_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        path = SHM_DIR / name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        try:
            tensor = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return cls(name, tensor)


def open_readonly(name: str) -> np.ndarray:
    """A read-only uint8 view of a worker's segment. ValueError for a name not of ours; OSError when it
    cannot be opened (gone, or another machine's)."""
    if not valid_name(name):
        raise ValueError(f"{name!r} is not a snapshot segment name")
    fd = os.open(SHM_DIR / name, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return np.frombuffer(mm, dtype=np.uint8)


def unlink(name: str) -> None:
    """Unlink a segment's name; its pages go when the last mapping does (a worker's tensor, a keeper's
    view)."""
    if valid_name(name):
        with contextlib.suppress(OSError):
            (SHM_DIR / name).unlink()


def sweep() -> int:
    """Unlink the segments whose creating process is gone. Returns how many."""
    n = 0
    with contextlib.suppress(OSError):
        for path in SHM_DIR.iterdir():
            m = _NAME.match(path.name)
            if m and not Path(f"/proc/{m.group(1)}").exists():
                unlink(path.name)
                n += 1
    return n
