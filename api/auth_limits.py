"""Rate limiting of failed authentications, per client address: after `max_failures` refusals within
`window_s` seconds a client is answered 429 with Retry-After until the oldest of them leaves the
window, whatever it sends. Guessing tokens then costs a guesser `window_s / max_failures` seconds each.
In memory, per API process (each process of a pair limits on its own)."""

from __future__ import annotations

import math
import threading
import time
from collections import deque


class FailedAuthLimiter:
    def __init__(self, max_failures: int = 30, window_s: float = 60.0, max_clients: int = 100_000) -> None:
        if max_failures < 1 or window_s <= 0:
            raise ValueError("max_failures must be at least 1 and window_s above 0")
        self.max_failures = max_failures
        self.window_s = window_s
        self.max_clients = max_clients  # bounds memory under many addresses
        self._failures: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def _recent(self, client: str, now: float) -> deque[float] | None:
        q = self._failures.get(client)
        if q is None:
            return None
        while q and q[0] <= now - self.window_s:
            q.popleft()
        if not q:
            del self._failures[client]
            return None
        return q

    def retry_after(self, client: str) -> int | None:
        """Seconds this client must wait before trying again, or None when it may try now."""
        now = time.monotonic()
        with self._lock:
            q = self._recent(client, now)
            if q is None or len(q) < self.max_failures:
                return None
            return max(1, math.ceil(q[0] + self.window_s - now))

    def failed(self, client: str) -> None:
        now = time.monotonic()
        with self._lock:
            q = self._recent(client, now)
            if q is None:
                if len(self._failures) >= self.max_clients:
                    self._failures.pop(next(iter(self._failures)))
                q = self._failures[client] = deque()
            q.append(now)
