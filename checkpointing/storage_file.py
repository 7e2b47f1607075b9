"""The persistent tier on a local (or network-mounted) file system.

Writes are atomic: bytes go to `<name>.partial`, are fsynced, renamed over the final name, and the
folder is fsynced, so a crash leaves either the old object or the whole new one. A full disk
(ENOSPC, EDQUOT, EFBIG) becomes `OutOfSpace` naming the path and the fix; the half-written
temporary file is removed.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from checkpointing.object_store import Chunk, ObjectMissing, ObjectStore, OutOfSpace, PutResult, StorageError

_PARTIAL = ".partial"
_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileStore(ObjectStore):
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root_uri = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"object key {key!r} must be relative and stay under {self.root}")
        return self.root / key

    def describe(self, key: str) -> str:
        return str(self._path(key))

    def put(self, key: str, chunks: Iterable[Chunk]) -> PutResult:
        path = self._path(key)
        tmp = path.with_name(path.name + _PARTIAL)
        digest = hashlib.sha256()
        size = 0
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                for chunk in chunks:
                    view = memoryview(chunk).cast("B")
                    digest.update(view)
                    f.write(view)
                    size += len(view)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(path.parent)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if e.errno in _SPACE_ERRNOS:
                raise OutOfSpace(
                    f"no space left writing {path} ({os.strerror(e.errno)}); free space on that volume "
                    "or point checkpoint.uri at a larger one"
                ) from e
            raise StorageError(f"cannot write {path}: {e.strerror or e}") from e
        return PutResult(size=size, sha256=digest.hexdigest())

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except FileNotFoundError as e:
            raise ObjectMissing(f"{path} does not exist") from e
        except OSError as e:
            raise StorageError(f"cannot read {path}: {e.strerror or e}") from e

    def size(self, key: str) -> int | None:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            return None

    def list(self, prefix: str = "") -> dict[str, int]:
        base = self._path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        keys: dict[str, int] = {}
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                if not name.endswith(_PARTIAL):
                    p = Path(dirpath, name)
                    with contextlib.suppress(FileNotFoundError):  # removed meanwhile (retention)
                        keys[p.relative_to(self.root).as_posix()] = p.stat().st_size
        return dict(sorted(keys.items()))

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as e:
            raise StorageError(f"cannot delete {self._path(key)}: {e.strerror or e}") from e

    def delete_prefix(self, prefix: str) -> None:
        if not prefix.strip("/"):
            raise ValueError("refusing to delete the whole checkpoint root; give a step folder")
        shutil.rmtree(self._path(prefix.rstrip("/")), ignore_errors=True)
