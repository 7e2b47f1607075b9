"""The small key/value interface the persistent tier writes through, and its errors.

Two backends implement it: `storage_file.FileStore` (local file system, atomic writes) and
`storage_s3.S3Store` (boto3, parallel multipart). Keys are '/'-separated paths relative to the
checkpoint root (`step-00000010/__0_0.distcp`). Every write returns the object's size and
SHA-256, computed while the bytes stream out, so the manifest can list them without a re-read.

No torch here: the CLI lists and verifies checkpoints through this interface alone.
"""

from __future__ import annotations

import abc
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

Chunk = bytes | bytearray | memoryview


class StorageError(Exception):
    """A persistent-storage operation failed; the message names the object and the fix."""


class ObjectMissing(StorageError):
    pass


class ChecksumMismatch(StorageError):
    pass


class OutOfSpace(StorageError):
    pass


@dataclass(frozen=True)
class PutResult:
    size: int
    sha256: str


class HashingReader:
    """A read()-able, non-seekable stream over a sequence of chunks that hashes what it hands out.

    Non-seekable on purpose: s3transfer then reads it strictly in order, so the running SHA-256
    covers the bytes exactly as uploaded.
    """

    def __init__(self, chunks: Iterable[Chunk]) -> None:
        self._it = iter(chunks)
        self._cur = memoryview(b"")
        self._hash = hashlib.sha256()
        self.size = 0

    def read(self, n: int = -1) -> bytes:
        out: list[bytes] = []
        want = n if n is not None and n >= 0 else None
        got = 0
        while want is None or got < want:
            if not len(self._cur):
                nxt = next(self._it, None)
                if nxt is None:
                    break
                self._cur = memoryview(nxt).cast("B")
                continue
            take = len(self._cur) if want is None else min(len(self._cur), want - got)
            piece = self._cur[:take]
            self._hash.update(piece)
            out.append(piece.tobytes())
            self._cur = self._cur[take:]
            got += take
        self.size += got
        return b"".join(out)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def sha256_of(data: Chunk) -> str:
    return hashlib.sha256(data).hexdigest()


class ObjectStore(abc.ABC):
    """Objects under one root (a folder or an s3://bucket/prefix)."""

    root_uri: str

    @abc.abstractmethod
    def put(self, key: str, chunks: Iterable[Chunk]) -> PutResult:
        """Write the concatenated chunks as one object, atomically (readers see all or nothing)."""

    def put_bytes(self, key: str, data: Chunk) -> PutResult:
        return self.put(key, [data])

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The whole object; ObjectMissing if absent."""

    @abc.abstractmethod
    def size(self, key: str) -> int | None:
        """The object's size, or None if it does not exist."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> dict[str, int]:
        """Keys under prefix (recursive), sorted, with their sizes."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove one object; missing is fine."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Remove every object under prefix (a 'folder'); missing is fine."""

    def describe(self, key: str) -> str:
        """A human name for an object, for error messages (never contains credentials)."""
        return f"{self.root_uri.rstrip('/')}/{key}"

    def get_verified(self, key: str, size: int, sha256: str) -> bytes:
        """The object, checked against its recorded size and SHA-256 (ChecksumMismatch otherwise)."""
        data = self.get(key)
        if len(data) != size:
            raise ChecksumMismatch(
                f"size mismatch for {self.describe(key)}: expected {size} bytes, found {len(data)}; "
                "the object was truncated or overwritten, use an older checkpoint"
            )
        actual = sha256_of(data)
        if actual != sha256:
            raise ChecksumMismatch(
                f"checksum mismatch for {self.describe(key)}: expected sha256 {sha256}, actual {actual}; "
                "the object is corrupt, use an older checkpoint"
            )
        return data

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the default has none."""
