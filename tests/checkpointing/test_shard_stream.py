"""The snapshot wire (checkpointing.shard_stream) between a real Keeper object and a client, over real
loopback sockets, without Ray: a shard lands byte for byte in the keeper's memory; a refusal (memory
full, a stale generation) comes back with the keeper's own error and the connection stays usable; a
wrong token or a malformed header gets the connection closed and nothing stored; the keeper on the
worker's own node copies the shard out of the worker's shared-memory segment, or keeps the segment
itself and hands it back once the shard is freed."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from checkpointing import shm_segment
from checkpointing.keeper import Keeper
from checkpointing.shard_stream import MAX_KEPT, KeeperRefused, ShardStream, StreamBroken


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
    assert keeper.memory_report()["frames"] == {"kept": 0, "shared_memory": 0, "socket": 2}  # refusals: not
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


def test_this_nodes_keeper_copies_a_shard_from_shared_memory(keeper: Keeper) -> None:
    """The blob stays off the socket: the keeper copies it out of the worker's segment, keeps its own copy,
    and unlinks the segment's name once the worker hangs up; a name it cannot open is refused (the worker
    then sends the bytes) and the connection goes on; a name not of ours closes the connection."""
    seg = shm_segment.Segment.create(300_000)
    data = seg.tensor.numpy()
    data[:] = np.random.default_rng(1).integers(0, 255, size=data.size, dtype=np.uint8)
    s = _stream(keeper)
    s.send(_header(step=1), b"l", b"e", memoryview(data), shm=seg.name)
    held = keeper._get("j", 0, 1, 0).blob
    assert np.array_equal(held, data) and held.ctypes.data != data.ctypes.data
    data[:10] = 7  # the worker's next step overwrites its buffer: the kept copy is the keeper's own
    assert not np.array_equal(held[:10], data[:10])
    s.send(_header(step=2), b"l", b"e", memoryview(data[:1000]), shm=seg.name)  # a prefix: mapped once
    assert np.array_equal(keeper._get("j", 0, 2, 0).blob, data[:1000])

    gone = shm_segment.Segment.create(10)
    gone.close()  # unlinked: the keeper cannot open it
    with pytest.raises(KeeperRefused) as e:
        s.send(_header(step=3), b"", b"", memoryview(data[:10]), shm=gone.name)
    assert e.value.kind == "SegmentUnavailable"
    s.send(_header(step=3), b"", b"", memoryview(data[:10]))  # the same connection, the bytes over it
    assert keeper.held("j", 0, 3) == [0]
    # Counted by how the bytes came (the refusal is not a frame stored).
    assert keeper.memory_report()["frames"] == {"kept": 0, "shared_memory": 2, "socket": 1}

    s.close()  # the worker hangs up: its segment's name goes (its pages with the last mapping)
    deadline = time.monotonic() + 10
    while (shm_segment.SHM_DIR / seg.name).exists():
        assert time.monotonic() < deadline, "the keeper never unlinked the segment of a worker that hung up"
        time.sleep(0.05)

    host, port, token = keeper.stream_address()
    with socket.create_connection((host, port), timeout=5) as raw:  # a path, not a segment name
        raw.sendall(token.encode())
        body = json.dumps({**_header(step=4), "layout": 0, "extras": 0, "blob": 4, "shm": "../etc/passwd"})
        raw.sendall(struct.pack("!Q", len(body)) + body.encode())
        assert raw.recv(1) == b""
    assert keeper.held("j", 0, 4) == []


def test_this_nodes_keeper_keeps_a_segment_and_hands_it_back_once_freed(keeper: Keeper) -> None:
    """With `keep` the shard's bytes are the worker's segment itself (no copy: a write into it shows in the
    keeper's shard). Retention freeing the shard hands the segment back in the next answer; a shard being
    read when it is freed is handed back when its reader is done, not before."""
    one, two = shm_segment.Segment.create(100_000), shm_segment.Segment.create(100_000)
    a, b = one.tensor.numpy(), two.tensor.numpy()
    a[:], b[:] = 3, 4
    s = _stream(keeper)
    s.send(_header(step=1), b"l", b"e", memoryview(a), shm=one.name, keep=True)
    assert s.kept
    held = keeper._get("j", 0, 1, 0).blob
    assert np.array_equal(held, a)
    a[:5] = 9  # the same pages (a worker writes into a kept segment only once it is handed back)
    assert held[:5].tolist() == [9] * 5
    s.send(_header(step=2), b"l", b"e", memoryview(b), shm=two.name, keep=True)
    blob = np.full(1000, 7, dtype=np.uint8)
    for step in (1, 2, 3):
        keeper.commit("j", 0, step)
    # Committed 2 and 3 are retained, 1 freed: its segment comes back with the next answer.
    assert s.released == []
    s.send(_header(step=4), b"", b"", memoryview(blob))
    assert s.released == [one.name]
    reading = keeper._shards[("j", 0, 2, 0)]
    reading.readers += 1  # a restore is copying shard 2 out (get_blob)
    keeper.commit("j", 0, 4)  # frees it: not handed back while it is read
    s.send(_header(step=5), b"", b"", memoryview(blob))
    assert s.released == [one.name]
    keeper._read_done(reading)  # the reader is done
    s.send(_header(step=6), b"", b"", memoryview(blob))
    assert s.released == [one.name, two.name]
    assert keeper.memory_report()["frames"] == {"kept": 2, "shared_memory": 0, "socket": 3}

    # It keeps MAX_KEPT at most for one worker; past that it copies (and says so).
    extra = [shm_segment.Segment.create(1000) for _ in range(MAX_KEPT + 1)]
    for i, seg in enumerate(extra):
        s.send(_header(gen=1, step=i), b"", b"", memoryview(seg.tensor.numpy()), shm=seg.name, keep=True)
        assert s.kept == (i < MAX_KEPT), i
    s.close()


def test_a_dead_workers_segments_are_swept() -> None:
    """A SIGKILLed worker never unlinks its segments: a keeper starting on the node unlinks those whose
    process is gone, and leaves a live process's alone."""
    child = subprocess.run([sys.executable, "-c", "import os, signal; from checkpointing.shm_segment import Segment; "
                            "s = Segment.create(4096); print(s.name, flush=True); os.kill(os.getpid(), signal.SIGKILL)"],
                           capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    assert child.returncode == -9, child.stderr
    dead = child.stdout.strip()
    mine = shm_segment.Segment.create(4096)
    try:
        assert (shm_segment.SHM_DIR / dead).exists()
        assert shm_segment.sweep() >= 1
        assert not (shm_segment.SHM_DIR / dead).exists() and (shm_segment.SHM_DIR / mine.name).exists()
    finally:
        mine.close()
        shm_segment.unlink(dead)


def test_the_handover_bench_runs_short(capsys: pytest.CaptureFixture[str]) -> None:
    """make bench's handover_bench, a short variant: every way prints its figures."""
    from tests.benchmarks import handover_bench

    handover_bench.main(["--mib", "1", "--rounds", "2"])
    out = capsys.readouterr().out
    assert all(f"  {way} " in out for way in handover_bench.WAYS) and "hand-over CPU vs socket" in out, out
