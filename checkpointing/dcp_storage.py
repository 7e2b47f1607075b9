"""torch.distributed.checkpoint (DCP) StorageWriter/StorageReader over an ObjectStore.

Each rank writes ONE object, `step-N/__<rank>_0.distcp`: the raw bytes of its tensors (and pickled
non-tensor values) back to back, streamed out with the SHA-256 computed on the way. Where each item
lies (file, offset, length, dtype, shape) goes into DCP's metadata as plain dicts, so the format
does not depend on our class names. The coordinator writes `.metadata` in `finish`, then calls
`on_commit` with every file's size and hash (rank 0 writes the manifest there, last).

Reading fetches each needed object whole, checks its SHA-256 against the manifest, and copies the
requested slices into the target tensors, which may be sharded differently (resharding is DCP's
planning; we only serve bytes).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint import Metadata, StorageReader, StorageWriter
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from checkpointing.manifest import METADATA_NAME, FileEntry, Manifest, data_file_name
from checkpointing.object_store import ObjectStore

CommitFn = Callable[[list[FileEntry]], None]


def _as_bytes_view(t: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """A zero-copy uint8 view of a CPU tensor's data (copying only if it is not contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return b"", t
    return flat.view(torch.uint8).numpy(), t


class ObjectStoreWriter(StorageWriter):
    def __init__(self, store: ObjectStore, prefix: str, on_commit: CommitFn | None = None) -> None:
        super().__init__()
        self.store = store
        self.prefix = prefix.strip("/")
        self.on_commit = on_commit
        self.is_coordinator = False
        self.bytes_written = 0  # this rank's data object

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Number each rank's plan: it names that rank's data object.
        return [dataclasses.replace(p, storage_data=i) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name = data_file_name(int(plan.storage_data))
        chunks: list[Any] = []
        keep: list[torch.Tensor] = []  # keeps contiguous copies alive while streaming
        metas: list[tuple[Any, dict[str, Any]]] = []
        offset = 0
        for item in plan.items:
            data = planner.resolve_data(item)
            if isinstance(data, torch.Tensor):
                buf, t = _as_bytes_view(data)
                keep.append(t)
                meta = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
            else:
                buf = data.getbuffer() if isinstance(data, io.BytesIO) else bytes(data)
                meta = {"dtype": None, "shape": None}
            length = memoryview(buf).nbytes
            meta.update(file=name, offset=offset, length=length)
            chunks.append(buf)
            metas.append((item.index, meta))
            offset += length
        results: list[WriteResult] = []
        if metas:
            put = self.store.put(f"{self.prefix}/{name}", chunks)
            self.bytes_written = put.size
            for index, meta in metas:
                meta.update(file_size=put.size, sha256=put.sha256)
                results.append(WriteResult(index=index, size_in_bytes=meta["length"], storage_data=meta))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files: dict[str, FileEntry] = {}
        storage: dict[Any, Any] = {}
        for rank_results in results:
            for r in rank_results:
                sd = r.storage_data
                files[sd["file"]] = FileEntry(sd["file"], int(sd["file_size"]), str(sd["sha256"]))
                storage[r.index] = {k: sd[k] for k in ("file", "offset", "length", "dtype", "shape")}
        metadata.storage_data = storage
        put = self.store.put_bytes(f"{self.prefix}/{METADATA_NAME}", pickle.dumps(metadata))
        entries = sorted(files.values(), key=lambda f: f.name)
        entries.append(FileEntry(METADATA_NAME, put.size, put.sha256))
        if self.on_commit is not None:
            self.on_commit(entries)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never inferred from a bare id: built explicitly by CheckpointManager


def _narrow(t: torch.Tensor, offsets: torch.Size, lengths: torch.Size) -> torch.Tensor:
    for dim, (off, ln) in enumerate(zip(offsets, lengths, strict=True)):
        if off != 0 or ln != t.shape[dim]:
            t = t.narrow(dim, off, ln)
    return t


class ObjectStoreReader(StorageReader):
    def __init__(self, store: ObjectStore, prefix: str, manifest: Manifest) -> None:
        super().__init__()
        self.store = store
        self.prefix = prefix.strip("/")
        self.files = {f.name: f for f in manifest.files}
        self.storage_data: dict[Any, Any] = {}

    def _get(self, name: str) -> bytes:
        entry = self.files.get(name)
        key = f"{self.prefix}/{name}"
        if entry is None:
            raise FileNotFoundError(
                f"{self.store.describe(key)} is not listed in the manifest; checkpoint is corrupt"
            )
        return self.store.get_verified(key, entry.size, entry.sha256)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return pickle.loads(self._get(METADATA_NAME))

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[Any]] = defaultdict(list)
        for req in plan.items:
            by_file[self.storage_data[req.storage_index]["file"]].append(req)
        for name in sorted(by_file):  # one object in memory at a time
            view = memoryview(self._get(name))
            for req in by_file[name]:
                sd = self.storage_data[req.storage_index]
                piece = view[sd["offset"] : sd["offset"] + sd["length"]]
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, io.BytesIO(piece.tobytes()))
                    continue
                dtype = getattr(torch, sd["dtype"])
                if sd["length"]:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we only read
                        src = torch.frombuffer(piece, dtype=dtype).reshape(sd["shape"])
                else:
                    src = torch.empty(sd["shape"], dtype=dtype)
                src = _narrow(src, req.storage_offsets, req.lengths)
                target = planner.resolve_tensor(req).detach()
                if target.shape != src.shape:
                    raise ValueError(
                        f"{req.storage_index.fqn}: stored slice {tuple(src.shape)} does not fit "
                        f"target {tuple(target.shape)}"
                    )
                target.copy_(src)
                planner.commit_tensor(req, target)
            del view
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False
