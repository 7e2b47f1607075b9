"""One rank's state tiers in one generation: the in-memory snapshot tier (keepers) and the persistent
tier, its restore (the committed snapshot, else the newest persistent checkpoint, else resume_from),
and the errors that mean its group broke."""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from workers import telemetry
from workers.protocol import CheckpointReport, SnapshotAck

log = logging.getLogger("unbroken.worker")

_ABORT_POLL_S = 0.05  # a wait for the last snapshot's send looks for an abort this often


def checkpoint_root(ckpt_cfg: Any, output_dir: str | Path) -> str:
    """Where a job's persistent checkpoints go: checkpoint.uri (the service made it the job's own), else
    <output_dir>/checkpoints."""
    return str(ckpt_cfg.uri or (Path(output_dir) / "checkpoints").resolve().as_uri())


class NothingToRestore(RuntimeError):
    """Training progressed but no state can be restored (the supervisor's reason): the job fails."""


def is_collective_error(e: BaseException) -> bool:
    """Whether `e` means the group broke under this rank (a peer or the rendezvous host failed), not that
    its own step failed: the supervisor keeps such a rank for the next generation, and replaces the other."""
    if isinstance(e, NothingToRestore):
        return False  # its words ("restore", "store") are not a broken group's
    # By its text alone: a run result carries only that. torch's DistError family by name (DistNetworkError
    # "Broken pipe": the rendezvous store's host lost under a rank joining a new generation; DistStoreError
    # has "store"), a socket's errors by theirs ("connection", "broken pipe", "timeout").
    # "is not registered": torch's ValueError for a group destroyed under an async save (a re-form).
    text = f"{type(e).__name__}: {e}".lower()
    return any(s in text for s in ("gloo", "nccl", "connection", "timed out", "timeout", "socket", "peer",
                                   "disterror", "distnetworkerror", "distbackenderror", "broken pipe", "store",
                                   "is not registered"))


def side_group(timeout_s: float) -> Any:
    """A gloo group of its own for a checkpoint tier, with the job's short timeout (None at world 1)."""
    from datetime import timedelta

    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


class Tiers:
    """The in-memory snapshot tier (keepers) and the persistent tier of one rank in one generation."""

    def __init__(self, worker: Any, rank: int, world_size: int, timeout_s: float,
                 keepers: dict[str, Any] | None, trainer: Any) -> None:  # fmt: skip
        from checkpointing.persistent import CheckpointManager

        self.w = worker
        self.rank, self.world = rank, world_size
        cc = worker.ckpt_cfg
        out = Path(worker.opts.output_dir)
        self.persist_every = cc.persist_every
        self.snap_every = cc.in_memory_every if keepers else 0
        self.keepers = keepers or {}
        root = checkpoint_root(cc, out)
        # Always there: it writes every persist_every steps and is the fallback of a restore.
        self.persistent: Any = CheckpointManager(cc, root, rank=rank, world_size=world_size,
                                                 process_group=side_group(timeout_s),
                                                 config=trainer.cfg.model_dump(mode="json"))  # export-hf needs it
        self.snap: Any = None
        self.optimizer = trainer.optimizer
        if self.snap_every:
            from checkpointing.snapshot import SnapshotClient

            # With the optimizer: the copy overlaps the next forward/backward; its step waits for it.
            self.snap = SnapshotClient(worker.opts.job_id, rank, world_size, worker.node_name, self.keepers,
                                       optimizer=self.optimizer, timeout_s=max(30.0, timeout_s),
                                       shared_memory=cc.snapshot_shared_memory)
        self._waited_seen = 0.0
        self._snap_in_flight: Any = None  # the last snapshot's handle, until its send is done

    def _hook_waits(self) -> float:
        """Total time optimizer steps have waited for the tiers' copies so far."""
        return (self.snap.copy_wait_s if self.snap is not None else 0.0) + self.persistent.copy_wait_s

    def after_step(self, trainer: Any, generation: int) -> float:
        """Snapshot to the keepers in the background (acked to the supervisor, which commits) and persist.

        Returns the training thread's blocking time for the step just done: what its optimizer step
        waited for copies still in flight, plus this call (state dict, layout, starting the copies).
        """
        t0 = time.perf_counter()
        waited = self._hook_waits() - self._waited_seen
        step = trainer.step
        if self.snap is not None and step % self.snap_every == 0 and self._wait_for_last_snapshot(generation):
            handle = self.snap.snapshot(trainer.state_dict(), step, generation)
            handle.add_done_callback(self._snapshotted)
            self._snap_in_flight = handle
        if self.persist_every and step % self.persist_every == 0:
            layout = {"dp": trainer.dims.dp, "world_size": self.world}
            handle = self.persistent.save_async(trainer.state_dict(), step, generation, layout,
                                                optimizer=self.optimizer)
            handle.add_done_callback(self._persisted)
        self._waited_seen = self._hook_waits()
        return waited + time.perf_counter() - t0

    def _wait_for_last_snapshot(self, generation: int) -> bool:
        """At most one snapshot is being sent: the next starts once the keepers hold the last one. So the
        snapshot of step s is held by the end of step s + in_memory_every, and a rank lost after that step
        costs at most the steps since s (one with in_memory_every: 1), however slow the sends get (without
        this wait they queue up behind each other, each holding a copy of the state). The wait counts in
        the step's blocking time; it is zero while a send takes less than the steps between snapshots.

        Returns False when the generation was called off meanwhile (no snapshot follows): a send to a keeper
        on a lost node may hang until TCP gives up, and the supervisor is waiting for this rank to stop."""
        h = self._snap_in_flight
        deadline = time.monotonic() + self.snap.timeout_s + 5.0
        while h is not None and not h.done() and time.monotonic() < deadline:
            if self.w.aborted(generation):
                return False
            with contextlib.suppress(Exception):  # a failed or late send is reported by its own ack
                h.result(timeout=_ABORT_POLL_S)
        return True

    def _snapshotted(self, res: Any) -> None:
        if res.ok:
            telemetry.record_snapshot(self.w.opts.job_id, self.rank, res.blocking_s + res.send_s, res.nbytes)
        # Held by a keeper is enough to ack: the commit counts the copies on the keepers alive then, so a
        # dead keeper (its node alive) does not stop commits until the next re-form replaces it.
        self.w.ack(SnapshotAck(self.w.name, res.generation, res.rank, time.time(), step=res.step, ok=bool(res.acked),
                               world_size=self.world, errors=dict(res.errors), acked=list(res.acked)))

    def _persisted(self, res: Any) -> None:
        """Every rank exports its shard's write; rank 0 tells the supervisor (one event per checkpoint)."""
        if res.ok:
            telemetry.record_checkpoint(self.w.opts.job_id, self.rank, res.blocking_s + res.upload_s,
                                        res.bytes_written)
        if self.rank != 0:
            return
        # A save whose group broke under it (a peer failed) is abandoned with its generation, not a
        # storage failure: the next generation writes that step again.
        broken = not res.ok and is_collective_error(RuntimeError(str(res.error)))
        self.w.send(CheckpointReport(self.w.name, res.generation, self.rank, time.time(), step=res.step, ok=res.ok,
                                     uri=res.uri, error=res.error, abandoned=broken))

    def restore(self, trainer: Any, target: dict[str, Any], *, in_place: bool = False) -> dict[str, Any]:
        """Load the committed snapshot the supervisor chose (resharded), else the newest persistent one.
        With data-parallel replicas, one rank of each replicate group reads the snapshot (one that kept
        its trainer, `in_place`, where there is one) and the others heal from it (checkpointing.peer_heal).

        `trainer.state_dict()` initialises a fresh optimizer's state (DCP runs a zero-lr step), which
        would shift a fresh run's Adam step count: it is only called when there is a state to load.
        """
        step, gen = target.get("step"), target.get("generation")
        if self.keepers and step is not None:
            from checkpointing import peer_heal
            from checkpointing.snapshot import restore_with_fallback

            peers = peer_heal.plan(trainer, in_place) if self.w.ckpt_cfg.heal_from_peer else None
            reads = peers is None or peers.reads(self.rank)
            t0 = time.perf_counter()
            state = trainer.state_dict()
            t_state = time.perf_counter() - t0
            info = restore_with_fallback(self.keepers, self.w.opts.job_id, state, self.persistent, step=step,
                                         generation=gen, prefer_node=self.w.node_name, read=reads, known=target.get("known"))
            t0 = time.perf_counter()
            if reads:
                trainer.load_state_dict(state)
            phases = {"state_dict_s": t_state, **info.phases, "set_s": time.perf_counter() - t0}
            if peers is not None and info.source != "persistent":  # a fallback: every rank loaded it
                nbytes = peer_heal.share(state, peers, self.rank)
                if not reads:
                    trainer.load_state_dict(state)
                    log.info("healed %d bytes from rank %d, a live replica", nbytes, peers.source)
            return {"step": int(trainer.step), "source": info.source, "fallback_reason": info.fallback_reason,
                    "uri": info.uri, "snapshot_world": info.world_size, "phases": phases}
        ckpt = self.persistent.latest_valid(deep=False)
        source, reader = "persistent", self.persistent
        if ckpt is None and target.get("resume") and self.w.ckpt_cfg.resume_from:
            source = "resume_from"
            reader, ckpt = self._resume_from(self.w.ckpt_cfg.resume_from)
        if ckpt is None:
            if target.get("must_restore"):  # the supervisor's reason: training progressed, state is gone
                skipped = "; ".join(f"step {s}: {why}" for s, why in self.persistent.skipped)
                raise NothingToRestore(str(target["must_restore"]) + (f" (persistent: {skipped})" if skipped else ""))
            return {"step": 0, "source": "fresh",
                    "skipped": [f"step {s}: {why}" for s, why in self.persistent.skipped]}
        state = trainer.state_dict()
        reader.load(state, ckpt)
        trainer.load_state_dict(state)
        return {"step": int(trainer.step), "source": source, "uri": ckpt.uri,
                "fallback_reason": "no committed in-memory snapshot" if self.keepers and source == "persistent"
                else None}

    def _resume_from(self, uri: str) -> tuple[Any, Any]:
        """(a reader, the checkpoint) for checkpoint.resume_from: a root's newest valid one, or one step folder.
        Read only: nothing is written there."""
        from checkpointing.manifest import parse_step_dir
        from checkpointing.persistent import CheckpointManager

        root, _, last = uri.rstrip("/").rpartition("/")
        step = parse_step_dir(last)
        cfg = self.w.ckpt_cfg.model_copy(update={"uri": root if step is not None else uri})
        reader = CheckpointManager(cfg, cfg.uri, rank=self.rank, world_size=self.world,
                                   process_group=self.persistent.pg)
        if step is None:
            return reader, reader.latest_valid(deep=False)
        found = [c for c in reader.list() if c.step == step and c.valid]
        if not found:
            raise FileNotFoundError(f"checkpoint.resume_from={uri}: no valid checkpoint of step {step} there")
        return reader, found[0]

    def uploading(self) -> int | None:
        """The step of the persistent save in flight, if any: a pause to re-form would wait for it."""
        persistent = self.persistent
        return persistent.uploading() if persistent is not None else None

    def wait(self) -> None:
        self.persistent.wait()

    def abandon(self) -> None:
        """After a failure: stop the background threads without waiting on a broken group."""
        with contextlib.suppress(Exception):
            self.persistent.abandon()
        if self.snap is not None:
            with contextlib.suppress(Exception):
                self.snap.abandon()
        self.snap = self.persistent = None

    def close(self) -> None:
        for part in (self.snap, self.persistent):
            if part is not None:
                with contextlib.suppress(Exception):
                    part.close()
