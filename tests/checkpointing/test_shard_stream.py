"""The snapshot wire (checkpointing.shard_stream) between a real Keeper object and a client, over real
loopback sockets, without Ray: a shard lands byte for byte in the keeper's memory; a refusal (memory
full, a stale generation) comes back with the keeper's own error and the connection stays usable; a
wrong token or a malformed header gets the connection closed and nothing stored."""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Iterator

import numpy as np
import pytest

from checkpointing.keeper import Keeper
from checkpointing.shard_stream import KeeperRefused, ShardStream, StreamBroken


@pytest.fixture
def keeper() -> Iterator[Keeper]:
    k = Keeper("n0", memory_limit_mb=2)
    yield k
    if k._stream is not None:
        k._stream.close()


def _stream(k: Keeper) -> ShardStream:
    host, port, token = k.stream_address()
    assert host == "127.0.0.1"
    return ShardStream((host, port), token, timeout_s=10)


def _header(gen: int = 0, step: int = 1, rank: int = 0) -> dict[str, object]:
    return {"job_id": "j", "generation": gen, "step": step, "rank": rank, "world_size": 2}


def test_a_shard_lands_byte_for_byte_and_refusals_keep_the_connection(keeper: Keeper) -> None:
    s = _stream(keeper)
    blob = np.random.default_rng(0).integers(0, 255, size=300_000, dtype=np.uint8)
    got = s.send(_header(), b"layout", b"extras", memoryview(blob))
    assert got["node"] == "n0" and got["nbytes"] == blob.nbytes + len(b"layout") + len(b"extras")
    layout, extras, world = keeper.get_meta("j", 0, 1, 0)
    assert (layout, extras, world) == (b"layout", b"extras", 2)
    held = keeper._get("j", 0, 1, 0).blob
    assert np.array_equal(held, blob) and held.ctypes.data != blob.ctypes.data  # a copy the keeper owns

    # Too big for the 2 MiB limit: the keeper's own error, with the fix; nothing kept.
    with pytest.raises(KeeperRefused, match="keeper_memory_limit_mb") as e:
        s.send(_header(step=2), b"", b"", memoryview(np.zeros(3 * 2**20, dtype=np.uint8)))
    assert e.value.kind == "KeeperMemoryFull"
    # Fenced: a shard from an older generation is refused.
    keeper.fence("j", 3)
    with pytest.raises(KeeperRefused) as e:
        s.send(_header(gen=2, step=3), b"", b"", memoryview(blob))
    assert e.value.kind == "StaleGeneration"
    # The same connection still works after both refusals (their bytes were read and dropped).
    s.send(_header(gen=3, step=4, rank=1), b"l", b"e", memoryview(blob[:1000]))
    assert keeper.held("j", 3, 4) == [1]
    assert sorted(keeper.memory_report()["jobs"]["j"]["shards"]) == [(3, 4, 1)]  # the fence dropped step 1
    s.close()


def test_a_wrong_token_or_a_bad_header_stores_nothing(keeper: Keeper) -> None:
    host, port, token = keeper.stream_address()
    with pytest.raises(StreamBroken):
        ShardStream((host, port), "0" * len(token), timeout_s=5).send(
            _header(), b"", b"", memoryview(np.zeros(10, dtype=np.uint8)))  # fmt: skip

    with socket.create_connection((host, port), timeout=5) as raw:  # a header with a negative size
        raw.sendall(token.encode())
        body = json.dumps({**_header(), "layout": 0, "extras": 0, "blob": -5}).encode()
        raw.sendall(struct.pack("!Q", len(body)) + body)
        assert raw.recv(1) == b""  # closed without an answer
    assert keeper.memory_report()["jobs"] == {} and keeper.used == 0

    with pytest.raises(StreamBroken):  # nobody listens there any more
        keeper._stream.close()
        ShardStream((host, port), token, timeout_s=2).send(_header(), b"", b"", memoryview(b"x"))
