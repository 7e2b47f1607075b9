"""The node's part of the two-level rendezvous (workers.group.rendezvous): the leader's relay.

A node's lowest rank hosts a small store for its node and a relay (`NodeRelay`) that is the node's one
client of the generation's master store; the node's other ranks talk to the relay only (`RelayStore`,
found through a port file named for the generation and leader), and the relay keeps what it read
from the master, so a key every rank reads crosses the master once per node (docs/scale.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from parallel import dist as pdist

log = logging.getLogger("unbroken.group")

RENDEZVOUS_DIR = Path(tempfile.gettempdir()) / "unbroken-rendezvous"
_POLL_S = 0.002  # first pause of a poll (a relay waiting on the master, a rank on its leader's file)
_POLL_MAX_S = 0.05
_REQ, _RES, _NREQ = "relay/q/", "relay/r/", "relay/n"
_STOP = "stop"


def relay_id(host: str, port: int, generation: int, leader: int) -> str:
    return f"{host}:{port}/gen{generation}/leader{leader}"


def _port_file(ident: str) -> Path:
    return RENDEZVOUS_DIR / ident.replace(":", "_").replace("/", "_")


def _prune_port_files(older_than_s: float = 3600.0) -> None:
    """Port files left by leaders killed during a rendezvous (a file is only read while its group forms)."""
    cutoff = time.time() - older_than_s
    for f in RENDEZVOUS_DIR.iterdir():
        with contextlib.suppress(OSError):
            if f.stat().st_mtime < cutoff:
                f.unlink()


def _poll_until(ready: Callable[[], bool], deadline: float, what: str,
                stop: Callable[[], bool] | None = None) -> None:
    """Until `ready()`; TimeoutError past `deadline`, or at once when `stop()` says to give up."""
    pause = _POLL_S
    while not ready():
        if time.monotonic() > deadline or (stop is not None and stop()):
            raise TimeoutError(what)
        time.sleep(pause)
        pause = min(_POLL_MAX_S, pause * 2)


class NodeRelay:
    """The node leader's relay: the node's one client of the master store for its other ranks.

    It hosts the node's local store. A rank's request (RelayStore) is a numbered key there; the relay
    does it on the master and writes the answer back. What it reads from the master it keeps: in a
    group's rendezvous a key is written once (an address, a unique id) and read by many, so each
    crosses the master once per node. Counters (`add`) and `check` always go to the master. A wait is
    a poll of `check` on the relay's own connection (a blocking wait would hold that connection, and
    the write another rank of the node is about to make would queue behind it: a deadlock)."""

    def __init__(self, master_host: str, master_port: int, ident: str, timeout_s: float) -> None:
        self.ident = ident
        self.timeout_s = timeout_s
        self.server = pdist.make_store("127.0.0.1", 0, 1, is_master=True, timeout_s=timeout_s)
        self.port = int(self.server.port)
        # Its own connection to the master: the leader's own rank waits on its own, and must not hold this one.
        self.master = pdist.make_store(master_host, master_port, 1, is_master=False, timeout_s=timeout_s)
        # The dispatcher's connection (it blocks in a wait) and the answers' (the leader's own thread may
        # block on the server's during the barrier).
        self._in = pdist.make_store("127.0.0.1", self.port, 1, is_master=False, timeout_s=timeout_s)
        self._out = pdist.make_store("127.0.0.1", self.port, 1, is_master=False, timeout_s=timeout_s)
        self._cache: dict[str, bytes] = {}
        self._cache_lock = threading.Lock()
        self._closed = threading.Event()
        self.stats = {"requests": 0, "master_reads": 0, "cache_hits": 0}
        self.server.set("relay/for", ident)
        self._thread = threading.Thread(target=self._dispatch, name="rendezvous-relay", daemon=True)
        self._thread.start()
        RENDEZVOUS_DIR.mkdir(parents=True, exist_ok=True)
        _prune_port_files()
        self.port_file = _port_file(ident)
        tmp = self.port_file.with_name(f"{self.port_file.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(str(self.port))
        os.replace(tmp, self.port_file)  # atomic: a rank never reads half a port

    def unpublish(self) -> None:
        with contextlib.suppress(Exception):
            self.port_file.unlink(missing_ok=True)

    def close(self) -> None:
        self._closed.set()
        self.unpublish()
        with contextlib.suppress(Exception):  # the stop request, numbered like any other
            self.server.set(f"{_REQ}{self.server.add(_NREQ, 1)}", pickle.dumps((_STOP, ())))
        self._thread.join(timeout=2.0)

    # ----------------------------------------------------------------- serving
    def _dispatch(self) -> None:
        i = 1
        while True:
            key = f"{_REQ}{i}"
            t0 = time.monotonic()
            try:
                self._in.wait([key], timedelta(seconds=1))
            except Exception:  # noqa: BLE001 - idle, or the connection was severed after a failure
                if self._closed.is_set():
                    return
                if time.monotonic() - t0 < 0.5:  # not a timeout: a broken connection, until close
                    self._closed.wait(0.05)  # (close wakes it: a rank leaving a failed group waited here)
                continue
            op, args = pickle.loads(self._in.get(key))
            self._in.delete_key(key)
            if op == _STOP:
                return
            self.stats["requests"] += 1
            if op in ("wait", "get", "multi_get") and not self._cached(args[0] if op != "get" else [args[0]]):
                # Blocks until the key is written: its own thread, so the node's other requests go on.
                threading.Thread(target=self._serve, args=(i, op, args), daemon=True).start()
            else:
                self._serve(i, op, args)
            i += 1

    def _cached(self, keys: Sequence[str]) -> bool:
        with self._cache_lock:
            return all(k in self._cache for k in keys)

    def _serve(self, i: int, op: str, args: tuple[Any, ...]) -> None:
        try:
            answer: tuple[str, Any] = ("ok", self._do(op, args))
        except Exception as e:  # noqa: BLE001 - raised again in the asking rank
            answer = ("err", f"{type(e).__name__}: {e}")
        with contextlib.suppress(Exception):  # the asking rank may be gone
            self._out.set(f"{_RES}{i}", pickle.dumps(answer))

    def _do(self, op: str, args: tuple[Any, ...]) -> Any:
        m = self.master
        if op == "get":
            return self._read([args[0]], self.timeout_s)[0]
        if op == "multi_get":
            return self._read(list(args[0]), self.timeout_s)
        if op == "wait":
            keys, timeout_s = args
            self._await(list(keys), self.timeout_s if timeout_s is None else timeout_s)
            return None
        if op == "check":
            return self._cached(args[0]) or m.check(list(args[0]))
        if op in ("delete_key", "append"):
            with self._cache_lock:
                self._cache.pop(args[0], None)
        return getattr(m, op)(*args)  # set, add, compare_set, delete_key, num_keys, multi_set, append

    def _await(self, keys: list[str], timeout_s: float) -> None:
        missing = [k for k in keys if not self._cached([k])]
        if missing:
            _poll_until(lambda: bool(self.master.check(missing)), time.monotonic() + timeout_s,
                        f"wait for {missing[:3]} timed out after {timeout_s:g}s")

    def _read(self, keys: list[str], timeout_s: float) -> list[bytes]:
        with self._cache_lock:
            missing = [k for k in keys if k not in self._cache]
        self.stats["cache_hits"] += len(keys) - len(missing)
        if missing:
            self._await(missing, timeout_s)
            values = self.master.multi_get(missing)
            self.stats["master_reads"] += len(missing)
            with self._cache_lock:
                self._cache.update(zip(missing, values, strict=True))
        with self._cache_lock:
            return [self._cache[k] for k in keys]


def _bytes(value: Any) -> bytes:
    """A value as torch hands it to a Python store (bytes, str, or a list of ints) -> bytes."""
    return value.encode() if isinstance(value, str) else bytes(value)


class RelayStore(dist.Store):
    """A non-leader rank's store: each operation is a request to its node's relay (NodeRelay), made
    through the node's local store; the rank has no connection to the master."""

    def __init__(self, local: dist.Store, timeout_s: float) -> None:
        super().__init__()
        self._local = local
        self._timeout_s = timeout_s

    def _call(self, op: str, *args: Any, wait_s: float | None = None) -> Any:
        i = self._local.add(_NREQ, 1)
        self._local.set(f"{_REQ}{i}", pickle.dumps((op, args)))
        key = f"{_RES}{i}"
        # A relayed wait ends at its own timeout; the answer gets a little longer to come back.
        self._local.wait([key], timedelta(seconds=(wait_s or self._timeout_s) + 5.0))
        status, value = pickle.loads(self._local.get(key))
        self._local.delete_key(key)
        if status != "ok":
            raise dist.DistStoreError(f"rendezvous relay: {value}")
        return value

    def set(self, key: str, value: bytes | str) -> None:
        self._call("set", key, _bytes(value))

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._call("compare_set", key, _bytes(expected), _bytes(desired))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        timeout_s = timeout.total_seconds() if timeout is not None else None
        self._call("wait", list(keys), timeout_s, wait_s=timeout_s)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", list(keys))

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key)

    def num_keys(self) -> int:
        return self._call("num_keys")

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call("multi_get", list(keys))

    def multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self._call("multi_set", list(keys), [_bytes(v) for v in values])

    def append(self, key: str, value: bytes | str) -> None:
        self._call("append", key, _bytes(value))

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> RelayStore:
        # Another thread's connection (e.g. NCCL's watchdog): its calls must not queue behind ours.
        local = self._local.clone()  # type: ignore[attr-defined]
        clone = RelayStore(local, self._timeout_s)
        KEPT_CLONES.append(clone)  # the C++ side holds no reference to the Python object (workers.group)
        return clone


def connect_to_leader(ident: str, deadline: float, timeout_s: float,
                      stop: Callable[[], bool] | None = None) -> dist.Store:
    """The local store of this node's leader's relay, found through its port file (TimeoutError past
    `deadline`, or once `stop()` is true)."""
    path = _port_file(ident)
    while True:
        _poll_until(path.exists, deadline, f"the node leader's relay ({ident}) did not start in time", stop)
        try:
            # The whole time left: a burst of connects to a fresh TCPStore can stall for seconds (measured
            # here: 5-10 s at 32+ at once), and a stale file is rare (ports are fresh every generation).
            left = max(1.0, deadline - time.monotonic())
            local = pdist.make_store("127.0.0.1", int(path.read_text()), 1, is_master=False, timeout_s=left)
            # check first: a port reused by a store that is no relay would hold a get until the timeout
            if local.check(["relay/for"]) and local.get("relay/for").decode() == ident:
                local.set_timeout(timedelta(seconds=timeout_s))
                return local
        except (OSError, ValueError, RuntimeError):  # a stale file (another relay) or half a port: look again
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the node leader's relay ({ident}) did not answer in time")
        time.sleep(_POLL_MAX_S)


KEPT_CLONES: list[RelayStore] = []  # clones of RelayStore made by torch while a group lives
