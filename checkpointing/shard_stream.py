"""The snapshot wire: a rank's shard streamed straight into a keeper's memory over one TCP connection.

    server = ShardStreamServer(keeper.receive_shard, host)      # in the keeper; address=(ip, port), token
    stream = ShardStream(server.address, server.token)          # in the worker, one per keeper, kept open
    reply = stream.send(meta, layout, extras, blob)             # blocks until the keeper holds the copy

Why not Ray: a `ray.put` of the shard plus a `put_shard` call per keeper costs, per snapshot, a copy into
the object store, the raylet's object transfer to the other node and the keeper's copy out of it,
about 25 ms of CPU per step for a 2.5 MB shard measured on 2 cores (the raylets' and keepers' CPU
time): on a machine whose cores train, that time is taken from training. Here the bytes cross the
socket once, from the worker's staging buffer into the blob the keeper keeps (`recv_into`), and the
keeper's answer comes back on the same connection.

A frame: an 8-byte length, a JSON header (job, generation, step, rank, world size, the lengths of what
follows), the layout and extras bytes, then the blob. To the keeper on the worker's own node the blob
does not cross the socket: the header names the worker's shared-memory segment (`shm`,
checkpointing.shm_segment) and the keeper copies it from there, or with `keep` keeps the segment itself
as the shard's bytes (at most MAX_KEPT a connection; past that it copies); a keeper that cannot open it
answers SegmentUnavailable and the worker sends that keeper the bytes instead. The answer: an 8-byte
length and a JSON object, {"ok": true, "result": {...}, "kept": bool, "released": [segments]} or
{"ok": false, "type": ..., "error": ..., "released": [...]}: `released` names the kept segments freed
since the last answer, which the worker may write into again. Nothing on the wire is unpickled; a connection starts with the keeper's token, which a worker learns through Ray, so only a
holder of a Ray handle to the keeper can write into it.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from checkpointing import shm_segment

log = logging.getLogger("unbroken.shard_stream")

__all__ = ["KeeperRefused", "SegmentUnavailable", "ShardStream", "ShardStreamServer", "StreamBroken"]

_LEN = struct.Struct("!Q")
TOKEN_BYTES = 32
MAX_HEADER = 1 << 20  # a header is a few hundred bytes; more means a confused peer
SOCKET_BUFFER = 4 << 20
# Segments a keeper keeps at once for one connection (as its shards' bytes, no copy): the two committed
# snapshots it retains, the one awaiting its commit and the one arriving. Past that it copies them.
MAX_KEPT = 4
# Fields of a frame's header and the types they must have (the server checks each before using it).
HEADER_FIELDS = {"job_id": str, "generation": int, "step": int, "rank": int, "world_size": int,
                 "layout": int, "extras": int, "blob": int}  # fmt: skip


class SegmentUnavailable(RuntimeError):
    """The keeper cannot open the shared-memory segment a frame names (gone, or another machine's)."""


class StreamBroken(ConnectionError):
    """The connection to a keeper broke (the keeper or its node is gone, or it hung up)."""


class KeeperRefused(RuntimeError):
    """The keeper answered, and refused the shard (memory full, a stale generation): `kind` names why."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket; StreamBroken if the peer hangs up first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise StreamBroken(f"the peer hung up after {got} of {len(view)} bytes")
        got += n


def _recv_bytes(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_exact(sock, memoryview(buf))
    return bytes(buf)


def _recv_json(sock: socket.socket) -> dict[str, Any]:
    (n,) = _LEN.unpack(_recv_bytes(sock, _LEN.size))
    if n > MAX_HEADER:
        raise StreamBroken(f"a {n}-byte header (at most {MAX_HEADER}): not an Unbroken shard stream")
    out = json.loads(_recv_bytes(sock, n))
    if not isinstance(out, dict):
        raise StreamBroken("a header that is not a JSON object")
    return out


def _json_frame(obj: dict[str, Any]) -> bytes:
    body = json.dumps(obj).encode()
    return _LEN.pack(len(body)) + body


# ---------------------------------------------------------------------- the keeper's end
# receive(header, layout, extras, fill, lend): lend is None, or (for a frame whose segment the keeper
# keeps) a callable returning (the segment's bytes, release), release to be called once they are freed.
Lend = Callable[[], tuple[np.ndarray, Callable[[], None]]]
Receive = Callable[[dict[str, Any], bytes, bytes, Callable[[np.ndarray], None], Lend | None], dict[str, Any]]


class _Kept:
    """The segments one connection's worker lent its keeper: how many it keeps now (at most MAX_KEPT)
    and those it freed since the last answer, which carries them so the worker may write into them
    again. A shard is freed on the keeper's own threads (a commit, a drop), hence the lock."""

    def __init__(self) -> None:
        self.count = 0
        self._released: list[str] = []
        self._lock = threading.Lock()

    def take(self) -> bool:
        """Room for one more kept segment (then counted), or False: copy this one."""
        with self._lock:
            if self.count >= MAX_KEPT:
                return False
            self.count += 1
            return True

    def untake(self) -> None:
        """A counted segment that was not kept after all (the shard was refused)."""
        with self._lock:
            self.count -= 1

    def give_back(self, name: str) -> None:
        with self._lock:
            self.count -= 1
            self._released.append(name)

    def drain(self) -> list[str]:
        with self._lock:
            out, self._released = self._released, []
        return out


class ShardStreamServer:
    """Listens on `host` (the node's address); one thread per connected worker.

    `receive(header, layout, extras, fill)` stores a shard: it reserves a blob of header["blob"] bytes
    and calls `fill(blob)`, which reads the bytes off the socket into it, or raises without calling it
    (the server then reads the bytes and drops them, so the connection stays in step).
    """

    def __init__(self, receive: Receive, host: str) -> None:
        self._receive = receive
        self.token = secrets.token_hex(TOKEN_BYTES // 2)
        self._sock = socket.create_server((host, 0), backlog=64)
        self.address: tuple[str, int] = (host, int(self._sock.getsockname()[1]))
        self._closed = False
        # Frames stored, by how their bytes came: "kept" (the worker's segment itself, no copy),
        # "shared_memory" (copied out of it) or "socket".
        self.frames = {"kept": 0, "shared_memory": 0, "socket": 0}
        self._frames_lock = threading.Lock()
        threading.Thread(target=self._accept, name="shard-stream-accept", daemon=True).start()

    def close(self) -> None:
        """Stop listening (connections already open end with their workers)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept thread (close alone leaves it listening)
        with contextlib.suppress(OSError):
            self._sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            _tune(conn)
            threading.Thread(target=self._serve, args=(conn,), name="shard-stream", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        segments: dict[str, np.ndarray] = {}  # this worker's shared-memory segments, mapped once each
        kept = _Kept()  # the segments this worker lent the keeper
        with conn:
            try:
                if not hmac.compare_digest(_recv_bytes(conn, TOKEN_BYTES), self.token.encode()):
                    log.warning("shard stream: a connection with a wrong token, closed")
                    return
                while True:
                    answer = self._one(conn, segments, kept)
                    answer["released"] = kept.drain()
                    conn.sendall(_json_frame(answer))
            except (StreamBroken, OSError):
                return  # the worker went away (or re-formed): nothing to answer
            except Exception as e:  # noqa: BLE001 - a malformed frame: say so once, drop the connection
                log.warning("shard stream: %s: %s; connection closed", type(e).__name__, e)
            finally:
                for name in segments:  # the worker is gone or done with them (a SIGKILLed one never unlinks)
                    shm_segment.unlink(name)

    def _one(self, conn: socket.socket, segments: dict[str, np.ndarray], kept: _Kept) -> dict[str, Any]:
        """Read one frame, store it; the answer to send back."""
        header = _recv_json(conn)
        for name, kind in HEADER_FIELDS.items():
            if not isinstance(header.get(name), kind) or (kind is int and header[name] < 0):
                raise ValueError(f"header field {name!r} is {header.get(name)!r}: want a {kind.__name__} >= 0")
        shm = header.get("shm")
        if shm is not None and not (isinstance(shm, str) and shm_segment.valid_name(shm)):
            raise ValueError(f"header field 'shm' is {shm!r}: want a snapshot segment name")
        keep = header.get("keep", False)
        if not isinstance(keep, bool) or (keep and shm is None):
            raise ValueError(f"header field 'keep' is {keep!r}: want true (only with 'shm') or false")
        layout = _recv_bytes(conn, header["layout"])
        extras = _recv_bytes(conn, header["extras"])
        keep = keep and kept.take()  # else the keeper copies it (it keeps MAX_KEPT at most)
        on_wire = shm is None  # the blob follows on the socket
        filled = False

        def mapped() -> np.ndarray:
            view = segments.get(shm)
            if view is None:
                try:
                    view = segments[shm] = shm_segment.open_readonly(shm)
                except OSError as e:
                    raise SegmentUnavailable(f"cannot open the shared-memory segment {shm}: {e}") from e
            if view.nbytes < header["blob"]:
                raise ValueError(f"segment {shm} has {view.nbytes} bytes for a {header['blob']}-byte shard")
            return view[: header["blob"]]

        def fill(blob: np.ndarray) -> None:
            nonlocal filled
            filled = True
            if blob.nbytes != header["blob"]:
                raise ValueError(f"blob of {blob.nbytes} bytes for a {header['blob']}-byte shard")
            if on_wire:
                _recv_exact(conn, memoryview(blob).cast("B"))
                return
            np.copyto(blob, mapped())

        def lend() -> tuple[np.ndarray, Callable[[], None]]:
            return mapped(), lambda: kept.give_back(shm)

        try:
            result = self._receive(header, layout, extras, fill, lend if keep else None)
        except StreamBroken:
            raise
        except Exception as e:  # noqa: BLE001 - refused (memory, fence): answered, the stream goes on
            if keep:
                kept.untake()  # not kept after all (the answer says so)
            if on_wire and not filled:
                self._drain(conn, header["blob"])
            return {"ok": False, "type": type(e).__name__, "error": str(e)}
        with self._frames_lock:
            self.frames["socket" if on_wire else "kept" if keep else "shared_memory"] += 1
        return {"ok": True, "result": result, "kept": keep}

    @staticmethod
    def _drain(conn: socket.socket, n: int) -> None:
        scratch = memoryview(bytearray(min(n, 1 << 20) or 1))
        while n > 0:
            chunk = scratch[: min(n, len(scratch))]
            _recv_exact(conn, chunk)
            n -= len(chunk)


# ---------------------------------------------------------------------- the worker's end
class ShardStream:
    """One worker's open connection to one keeper; `send` is called from one thread at a time."""

    def __init__(self, address: tuple[str, int], token: str, timeout_s: float) -> None:
        try:
            self._sock = socket.create_connection(tuple(address), timeout=timeout_s)
        except OSError as e:
            raise StreamBroken(f"cannot connect to the keeper at {address[0]}:{address[1]}: {e}") from e
        _tune(self._sock)
        self.address = address
        self.released: list[str] = []  # kept segments the keeper has freed (the caller drains it)
        self.kept = False  # whether the keeper kept the last shard's segment (asked for with `keep`)
        try:
            self._sock.sendall(token.encode())
        except OSError as e:
            self.close()
            raise StreamBroken(f"the keeper at {address[0]}:{address[1]} hung up: {e}") from e

    def send(self, header: dict[str, Any], layout: bytes, extras: bytes, blob: memoryview,
             shm: str | None = None, keep: bool = False) -> dict[str, Any]:  # fmt: skip
        """Send one shard and wait for the keeper's answer: its result, or KeeperRefused. With `shm`
        (the name of the segment `blob` lies in, from its start) the keeper copies it from there; with
        `keep` as well it may keep the segment itself as the shard's bytes (no copy; `kept` says whether it
        did, up to MAX_KEPT at once): then the segment must not be written until its name comes back in
        `released` (names added by every answer)."""
        head = dict(header, layout=len(layout), extras=len(extras), blob=len(blob))
        if shm is not None:
            head["shm"] = shm
            if keep:
                head["keep"] = True
        try:
            self._sock.sendall(_json_frame(head) + layout + extras)
            if shm is None:
                self._sock.sendall(blob)
            reply = _recv_json(self._sock)
        except (OSError, StreamBroken) as e:
            self.close()
            raise StreamBroken(f"the keeper at {self.address[0]}:{self.address[1]}: {e}") from e
        self.released.extend(str(n) for n in reply.get("released") or ())
        if not reply.get("ok"):
            raise KeeperRefused(str(reply.get("type")), str(reply.get("error")))
        self.kept = bool(reply.get("kept"))
        return dict(reply.get("result") or {})

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
