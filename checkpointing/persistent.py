"""The persistent checkpoint tier: asynchronous DCP saves to file:// or s3://, retention, loading.

    mgr = CheckpointManager(cfg, default_root, rank=r, world_size=w,    # collective when w > 1
                            config=trainer.cfg.model_dump(mode="json"))  # into every manifest (export-hf)
    handle = mgr.save_async(trainer.state_dict(), step, generation, layout,
                            optimizer=trainer.optimizer)  # host copy overlaps the next forward/backward
    ...train on...
    result = handle.result()           # SaveResult(ok=..., error=...); never raises storage errors
    info = mgr.latest_valid()          # collective when w > 1; mgr.skipped says why newer ones were not
    state = trainer.state_dict()       # built for the CURRENT mesh (fresh optimizer state included)
    mgr.load(state, info)              # in place, resharding as needed; then trainer.load_state_dict(state)

Saving: the state is copied to reused host buffers (HostStager): on the training thread, or, with
`optimizer=`, on the upload thread while the next forward/backward runs (that optimizer's next
step waits for the copy). The single background thread then runs `dcp.save` over the copy on a
dedicated gloo group (its collectives never interleave with training's), each rank streams one
object, and rank 0 writes `.metadata` and then the manifest. At most one save is in flight:
`save_async` first waits for the previous one (all ranks do, so the collective sequence stays
aligned; skipping on some ranks only would deadlock). A failed save (full disk, store down,
fenced) is reported in its SaveResult, logged, kept in `last_error`, and never raised into the
training step.

The process group is captured at construction: after the job's group is re-formed (a new
generation or world size), build a new CheckpointManager (after `close()` on the old one).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from checkpointing.catalog import (
    CheckpointInfo,
    VerifyReport,
    find_latest_valid,
    list_checkpoints,
    max_generation,
    read_fences,
    verify_checkpoint,
    write_fence,
)
from checkpointing.config import CheckpointConfig
from checkpointing.dcp_storage import ObjectStoreReader, ObjectStoreWriter
from checkpointing.manifest import MANIFEST_NAME, FileEntry, Manifest, step_dir
from checkpointing.object_store import ChecksumMismatch, ObjectMissing, StorageError
from checkpointing.state import HostStager, map_tensors, ready_event
from checkpointing.uri import open_store

log = logging.getLogger("unbroken.checkpoint")

__all__ = [
    "CheckpointInfo",
    "CheckpointManager",
    "CorruptCheckpoint",
    "SaveHandle",
    "SaveResult",
    "VerifyReport",
]


@dataclass
class SaveResult:
    step: int
    generation: int
    ok: bool
    error: str | None = None
    uri: str = ""
    bytes_written: int = 0  # this rank's data object
    blocking_s: float = 0.0  # time the training thread was held (host copy, or waiting in optimizer.step)
    upload_s: float = 0.0  # background time: planning, upload, metadata, manifest, retention


class SaveHandle:
    """A save in flight. `result()` waits and returns a SaveResult; storage errors are inside it."""

    def __init__(self, step: int, staged: threading.Event, blocking_s: float) -> None:
        self.step = step
        self.staged = staged  # set once the state's tensors are copied to host memory
        self.blocking_s = blocking_s  # training-thread time: the call, plus any wait in optimizer.step
        self._future: Future[SaveResult] = Future()

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Wait until the host copy is complete (then the live state may change again)."""
        return self.staged.wait(timeout)

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> SaveResult:
        res = self._future.result(timeout)
        res.blocking_s = self.blocking_s
        return res

    def add_done_callback(self, fn: Callable[[SaveResult], None]) -> None:
        """fn(result) on the upload thread once the save ends (ok or not)."""
        self._future.add_done_callback(lambda f: fn(f.result()))


def _describe_failure(e: BaseException) -> str:
    """The root causes of a (possibly multi-rank) DCP failure, one line each."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, wrapped in sorted(failures.items()):
            exc = wrapped[0] if isinstance(wrapped, tuple) else wrapped  # (exception, stack summary)
            parts.append(f"rank {rank}: {exc}")
        return "; ".join(parts)
    return f"{type(e).__name__}: {e}" if not isinstance(e, StorageError) else str(e)


def _root_causes(e: BaseException) -> list[BaseException]:
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        return [w[0] if isinstance(w, tuple) else w for w in failures.values()]
    return [e.__cause__ or e]


class CorruptCheckpoint(StorageError):
    """Loading failed because stored bytes did not match the manifest (an older one may be fine)."""


@contextlib.contextmanager
def _quiet_single_process(distributed: bool) -> Iterator[None]:
    """DCP warns that it 'assumes a single process' on every call at world 1: that is our intent."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


class CheckpointManager:
    def __init__(
        self,
        cfg: CheckpointConfig,
        default_root: str,
        *,
        rank: int,
        world_size: int,
        process_group: dist.ProcessGroup | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        """`config` (JSON data, normally the EngineConfig the state is trained with) goes into every
        manifest: with it a checkpoint alone is enough to rebuild the model (`unbroken export-hf`)."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} world_size={world_size}: need 0 <= rank < world_size")
        try:
            # A copy, checked once: later changes to the caller's dict stay out of the manifests.
            self.config: dict[str, Any] | None = json.loads(json.dumps(config)) if config is not None else None
        except TypeError as e:
            raise ValueError(f"config must be JSON-serializable (it goes into the manifest): {e}") from None
        self.cfg = cfg
        self.uri = cfg.uri or default_root
        self.store = open_store(self.uri, cfg.s3)
        self.rank = rank
        self.world_size = world_size
        self.distributed = world_size > 1
        if self.distributed and not dist.is_initialized():
            raise RuntimeError(
                f"world_size={world_size} needs torch.distributed initialised before CheckpointManager"
            )
        # A separate gloo group: the upload thread's collectives must not interleave with training's.
        self.pg = process_group
        if self.distributed and self.pg is None:
            self.pg = dist.new_group(backend="gloo")
        if self.distributed and (dist.get_world_size(self.pg), dist.get_rank(self.pg)) != (world_size, rank):
            raise ValueError(
                f"rank={rank} world_size={world_size} disagree with the process group "
                f"(rank {dist.get_rank(self.pg)} of {dist.get_world_size(self.pg)}); pass the group's values"
            )
        self._stager = HostStager()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-upload")
        self._pending: SaveHandle | None = None
        self._hooked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._hook_handles: list[Any] = []
        self.last_error: str | None = None
        self.skipped: list[tuple[int, str]] = []
        self.copy_wait_s = 0.0  # total time optimizer steps waited for host copies (training-thread time)

    # ---------------------------------------------------------------- saving
    def save_async(
        self,
        state: dict[str, Any],
        step: int,
        generation: int,
        layout: dict[str, Any],
        *,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> SaveHandle:
        """Copy `state` to host memory, then upload it in the background. Collective.

        Without `optimizer` the copy happens here (the training thread blocks for it). With it, only
        the Python values are copied here; the tensors are copied on the upload thread while training
        goes on, and that optimizer's next `step()` waits until the copy is complete: parameters and
        optimizer state change only there. Then nothing else may modify the state's tensors in place
        before that step (or `handle.wait_staged()`); forward/backward and grad clipping only read them.
        """
        if step < 0 or generation < 0:
            raise ValueError(f"step={step} generation={generation}: both must be >= 0")
        try:
            json.dumps(layout)
        except TypeError as e:
            raise ValueError(f"layout must be JSON-serializable (it goes into the manifest): {e}") from None
        self.wait()  # at most one save in flight
        t0 = time.perf_counter()
        staged_evt = threading.Event()
        if optimizer is None:
            staged = self._stager.stage(state)
            staged_evt.set()
            task = (self._save_staged, staged)
        else:
            self._hook(optimizer)
            skeleton = map_tensors(state, lambda _path, t: t)  # Python leaves copied now, tensors later
            # CUDA: the upload thread's copies wait for this point of the training stream, not later work.
            task = (self._stage_then_save, skeleton, staged_evt, ready_event())
        blocking = time.perf_counter() - t0
        handle = SaveHandle(step, staged_evt, blocking)
        self._pending = handle
        handle._future = self._executor.submit(*task, step, generation, dict(layout), blocking)
        return handle

    def _hook(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer not in self._hooked:
            self._hooked.add(optimizer)
            self._hook_handles.append(optimizer.register_step_pre_hook(self._before_optimizer_step))

    def _before_optimizer_step(self, *_: Any) -> None:
        handle = self._pending
        if handle is not None and not handle.staged.is_set():
            t0 = time.perf_counter()
            handle.staged.wait()
            waited = time.perf_counter() - t0
            handle.blocking_s += waited
            self.copy_wait_s += waited

    def _stage_then_save(
        self,
        skeleton: dict[str, Any],
        staged_evt: threading.Event,
        ready: Any,
        step: int,
        generation: int,
        layout: dict[str, Any],
        blocking: float,
    ) -> SaveResult:
        try:
            staged = self._stager.stage(skeleton, ready)
        except Exception as e:  # noqa: BLE001 - reported in the result, like any failed save
            res = SaveResult(step, generation, ok=False, error=f"staging failed: {type(e).__name__}: {e}")
            self.last_error = res.error
            log.error("checkpoint step %d: %s", step, res.error)
            return res
        finally:
            staged_evt.set()
        return self._save_staged(staged, step, generation, layout, blocking)

    def save(self, state: dict[str, Any], step: int, generation: int, layout: dict[str, Any]) -> SaveResult:
        return self.save_async(state, step, generation, layout).result()

    def uploading(self) -> int | None:
        """The step of the save in flight (its upload not ended), if any."""
        pending = self._pending
        return pending.step if pending is not None and not pending.done() else None

    def wait(self) -> SaveResult | None:
        """Wait for the save in flight, if any, and return its result."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def _commit(self, step: int, generation: int, layout: dict[str, Any], files: list[FileEntry]) -> None:
        """On the coordinator, after every rank's object and .metadata are stored: the manifest, last."""
        for f in read_fences(self.store):
            if f.generation > generation:
                raise StorageError(
                    f"fenced: generation {f.generation} resumed from step {f.resume_step}; generation "
                    f"{generation} may not commit step {step} (this worker is stale and should stop)"
                )
        m = Manifest(step=step, generation=generation, world_size=self.world_size, layout=layout, files=files,
                     config=self.config)  # fmt: skip
        self.store.put_bytes(f"{step_dir(step)}/{MANIFEST_NAME}", m.to_json().encode())

    def _save_staged(
        self, staged: dict[str, Any], step: int, generation: int, layout: dict[str, Any], blocking: float
    ) -> SaveResult:
        t0 = time.perf_counter()
        res = SaveResult(step, generation, ok=False, uri=f"{self.store.root_uri.rstrip('/')}/{step_dir(step)}",
                         blocking_s=blocking)  # fmt: skip
        writer = ObjectStoreWriter(
            self.store, step_dir(step), on_commit=lambda files: self._commit(step, generation, layout, files)
        )
        try:
            if self.rank == 0:
                # Re-saving a step: drop its old manifest first, so "manifest => complete" holds
                # throughout (other ranks cannot write before rank 0 joins DCP's planning). Never
                # raise here: the other ranks are entering the collective save.
                try:
                    self.store.delete(f"{step_dir(step)}/{MANIFEST_NAME}")
                except StorageError as e:
                    log.warning("could not clear the old manifest of %s: %s", step_dir(step), e)
            with _quiet_single_process(self.distributed):
                dcp.save(staged, storage_writer=writer, process_group=self.pg, no_dist=not self.distributed)
            res.ok = True
            if self.rank == 0:
                self._retain()
        except Exception as e:  # noqa: BLE001 - reported, never raised into training
            res.error = _describe_failure(e)
        except BaseException as e:  # DCP's CheckpointException derives from BaseException
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            res.error = _describe_failure(e)
        res.upload_s = time.perf_counter() - t0
        if res.ok:
            res.bytes_written = writer.bytes_written
            log.info("checkpoint step %d saved to %s in %.2fs", step, res.uri, res.upload_s)
        else:
            self.last_error = res.error
            log.error("checkpoint step %d to %s failed (training continues): %s", step, res.uri, res.error)
        return res

    def _retain(self) -> None:
        """Keep the newest `keep_last` complete checkpoints; delete every step folder older than them, and
        every incomplete one older than the newest complete (a save a failure broke never completes later:
        the group that made it is gone, and a stale rank's upload is fenced)."""
        try:
            infos = list_checkpoints(self.store)
            complete = [i for i in infos if i.valid]
            if not complete:
                return
            oldest_kept = complete[-min(self.cfg.keep_last, len(complete))].step
            newest = complete[-1].step
            for info in infos:
                if info.step < oldest_kept or (not info.valid and info.step < newest):
                    self.store.delete_prefix(info.prefix)
        except StorageError as e:  # retention failing must not fail the save
            log.warning("checkpoint retention under %s failed: %s", self.store.root_uri, e)

    # ---------------------------------------------------------------- finding and loading
    def _from_rank0(self, fn: Any) -> Any:
        """Run fn on rank 0 and give every rank its result (or its error)."""
        if not self.distributed:
            return fn()
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box[0] = ("ok", fn())
            except Exception as e:  # noqa: BLE001 - re-raised on every rank below
                box[0] = ("err", str(e))
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.pg, 0), group=self.pg)
        kind, value = box[0]
        if kind == "err":
            raise StorageError(value)
        return value

    def latest_valid(self, deep: bool = True) -> CheckpointInfo | None:
        """The newest valid checkpoint (collective). `self.skipped` lists newer ones and why not.

        deep=True re-hashes every file of the candidate (rank 0 reads it once).
        """
        self.wait()  # the upload thread uses the same group
        info, skipped = self._from_rank0(lambda: find_latest_valid(self.store, deep=deep))
        self.skipped = skipped
        for step, why in skipped:
            log.warning("skipping checkpoint %s: %s", step_dir(step), why)
        return info

    def load(self, state: dict[str, Any], info: CheckpointInfo) -> None:
        """Load checkpoint `info` into `state` in place (collective).

        `state` must be built for the current mesh, e.g. `get_state_dict(model, optimizer)` on a
        freshly built model and optimizer: DCP reshards from the stored layout to it. Only the keys
        present in `state` are loaded (its structure decides what is read).
        """
        if info.manifest is None:
            raise StorageError(
                f"{info.uri}: {info.reason or 'incomplete: no manifest'}; pick another checkpoint"
            )
        self.wait()
        reader = ObjectStoreReader(self.store, info.prefix, info.manifest)
        try:
            with _quiet_single_process(self.distributed):
                dcp.load(state, storage_reader=reader, process_group=self.pg, no_dist=not self.distributed)
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            kind = StorageError
            if any(isinstance(c, ChecksumMismatch | ObjectMissing) for c in _root_causes(e)):
                kind = CorruptCheckpoint
            raise kind(f"loading {info.uri} failed: {_describe_failure(e)}") from None

    def load_latest(self, state: dict[str, Any]) -> CheckpointInfo | None:
        """Load the newest loadable checkpoint into `state` (collective), reading it only once.

        Candidates pass the cheap check (manifest, sizes, fencing); the load itself verifies the
        SHA-256 of every object it reads, and a corrupt candidate is skipped for the next older
        one (`self.skipped` says why). Returns None when there is none (state untouched).
        """
        self.wait()
        infos = self._from_rank0(lambda: list_checkpoints(self.store))
        self.skipped = []
        for info in reversed(infos):
            if not info.valid:
                self.skipped.append((info.step, info.reason or "invalid"))
                continue
            try:
                self.load(state, info)
            except CorruptCheckpoint as e:
                self.skipped.append((info.step, str(e)))
                log.warning("skipping checkpoint %s: %s", info.prefix, e)
                continue
            return info
        return None

    # ---------------------------------------------------------------- inspection and fencing
    def list(self) -> list[CheckpointInfo]:
        return list_checkpoints(self.store)

    def verify(self, step: int) -> VerifyReport:
        return verify_checkpoint(self.store, step)

    def max_generation(self) -> int | None:
        """The highest generation recorded under the root: a resumed run must use a higher one."""
        return max_generation(self.store)

    def fence(self, generation: int, resume_step: int) -> None:
        """Record that `generation` resumed from `resume_step` (rank 0 writes; call before saving)."""
        if self.rank == 0:
            write_fence(self.store, generation, resume_step)

    def abandon(self) -> None:
        """After a failure: let go without waiting for the save in flight (its group may be broken).

        Optimizer hooks are removed and queued work is cancelled; an upload already running ends on
        its own (its collectives fail with the group). Its checkpoint has no manifest, so it never counts.
        """
        for h in self._hook_handles:
            h.remove()
        self._hook_handles.clear()
        self._pending = None
        self._executor.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Finish the save in flight, unhook optimizers, stop the upload thread (the group stays)."""
        try:
            self.wait()
        finally:
            for h in self._hook_handles:
                h.remove()
            self._hook_handles.clear()
            self._executor.shutdown(wait=True)

    @property
    def staging_bytes(self) -> int:
        return self._stager.nbytes()
