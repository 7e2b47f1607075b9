"""The snapshot committer: the ranks' snapshot acks, the commit, and the snapshot a new generation restores.

A snapshot (generation, step) is committed once every rank acknowledged it and the keepers hold the
copies; only up to the last step whose metrics row is written, so a restore never skips a step
whose row was lost (e.g. held in memory when this supervisor crashed): it goes back and re-runs it.
Before a new generation restores, the keepers are also asked what they hold whole (acks are fire and
forget: those sent while this supervisor was down never came), so it restores the newest such step.
The keepers themselves (started, watched, started again) are service.supervisor.keeper_set's.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from service.supervisor.context import JobRun
from service.supervisor.keeper_set import KeeperSet
from service.supervisor.reporter import Reporter

log = logging.getLogger("unbroken.supervisor")

# What the keepers hold: {(generation, step): (world size, {rank: [nodes]})}.
Held = dict[tuple[int, int], tuple[int, dict[int, list[str]]]]
_COMMIT_WAIT_S = 0.02  # a commit waits this long for the keepers' answers; later ones are read next time
_ROUND_GIVE_UP_S = 30.0  # a keeper that has not answered a commit's call by then counts as failed


@dataclass
class _Round:
    """One round of calls to the keepers about snapshot `key`: which shards they hold ("held"), or
    mark it committed ("commit"). Read without blocking the watch loop."""

    kind: str
    key: tuple[int, int]
    calls: dict[str, Any]  # node -> ObjectRef
    sent: float = field(default_factory=time.monotonic)

    def answers(self, wait_s: float) -> tuple[dict[str, Any], dict[str, str]] | None:
        """({node: answer}, {node: why it failed}) once every keeper answered (one silent for
        _ROUND_GIVE_UP_S counts as failed); None before."""
        import ray

        from checkpointing.keepers import read_answers

        refs = list(self.calls.values())
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        if len(done) < len(refs) and time.monotonic() - self.sent < _ROUND_GIVE_UP_S:
            return None
        return read_answers(self.calls, 0)


class SnapshotCommitter:
    def __init__(self, run: JobRun, reporter: Reporter) -> None:
        self.run = run
        self.reporter = reporter
        self.keeper_set = KeeperSet(run, reporter)  # the job's keepers, by node
        # (generation, step) -> {"world", "ranks": set, "held": {rank: nodes whose keeper acked its copy}}
        self._acks: dict[tuple[int, int], dict[str, Any]] = {}
        self.committed: tuple[int, int] | None = None  # the newest committed snapshot (generation, step)
        self.ever_committed = False
        self.snapshot_errors = 0
        self._asked_keepers = False  # restore_target has asked the keepers once (after our restart: the first)
        self._round: _Round | None = None  # the commit's calls to the keepers in flight (commit)
        self._asked_about: tuple[int, int] | None = None  # the last snapshot the keepers were asked about

    @property
    def keepers(self) -> dict[str, Any]:
        """The job's keepers' handles, by node name."""
        return self.keeper_set.handles

    def on_ack(self, generation: int, step: int, rank: int, world_size: int, ok: bool,
               acked: list[str] | None = None) -> None:  # fmt: skip
        """A rank's snapshot note (called under the run's lock); `acked`: the nodes holding its copies."""
        if not ok:
            self.snapshot_errors += 1
            return
        key = (generation, step)
        if self.committed is None or key > self.committed:
            entry = self._acks.setdefault(key, {"world": world_size, "ranks": set(), "held": {}})
            entry["ranks"].add(rank)
            entry["held"][rank] = list(acked or [])

    def commit(self) -> None:
        """Commit the newest snapshot every rank has acknowledged, up to the last metrics row written
        (to metrics.jsonl and the store: Reporter.committable_step).

        Never waits on a keeper for more than _COMMIT_WAIT_S: the watch loop calls this, and a keeper on
        a node just lost may not answer for seconds (until Ray learns the node is gone), while that loop
        is what finds the loss (goodput_bench, 2026-11-29: a commit blocked on the lost node's keeper
        delayed a node loss's detection to 1.9 s). One round of calls is in flight at a time; its answers
        are read on later calls."""
        self.reporter.flush_metrics()
        if self._round is not None and not self._read_round():
            return
        with self.run.lock:
            ready = sorted((k for k, v in self._acks.items()
                            if len(v["ranks"]) >= v["world"] and k[1] <= self.reporter.committable_step),
                           reverse=True)
        if not ready or not self.keepers:
            return
        from checkpointing.keepers import commit_nodes, held_on

        for key in ready:  # the newest the acks show held enough (one round: the commit)
            acks = self._acks[key]
            try:
                nodes = commit_nodes(held_on(self.keepers, acks["held"]), self.run.job_id, key[1], acks["world"])
            except ValueError as e:
                log.warning("commit of snapshot %s: %s", key, e)
                continue
            if nodes is not None:
                self._send("commit", key, nodes)
                return
        if ready[0] != self._asked_about:  # the acks show too few copies: ask the keepers what they hold
            self._asked_about = ready[0]
            self._send("held", ready[0], list(self.keepers))

    def _send(self, kind: str, key: tuple[int, int], nodes: list[str]) -> None:
        if not nodes:
            return
        calls = {n: getattr(self.keepers[n], kind).remote(self.run.job_id, key[0], key[1]) for n in nodes}
        self._round = _Round(kind, key, calls)
        self._read_round()

    def _read_round(self) -> bool:
        """Take the round in flight's answers if they are all in (waiting _COMMIT_WAIT_S at most);
        returns whether none is in flight now."""
        r = self._round
        assert r is not None
        answers = r.answers(_COMMIT_WAIT_S)
        if answers is None:
            return False
        self._round = None
        held, failed = answers
        with self.run.lock:
            acks = self._acks.get(r.key)
        if r.kind == "commit":
            if failed:  # a keeper died since its ack: ask the keepers that live what they hold
                log.warning("commit of snapshot %s failed: %s", r.key, failed)
                if acks is not None:
                    self._send("held", r.key, list(self.keepers))
                return self._round is None
            with self.run.lock:
                if self.committed is None or r.key > self.committed:
                    self.committed = r.key
                self.ever_committed = True
                for k in [k for k in self._acks if k <= r.key]:
                    self._acks.pop(k)
            return True
        if acks is None:  # committed since, or fenced: nothing to do with the answers
            return True
        from checkpointing.keepers import commit_nodes

        try:
            nodes = commit_nodes(held, self.run.job_id, r.key[1], acks["world"])
        except ValueError as e:
            log.warning("commit of snapshot %s: %s", r.key, e)
            return True
        if nodes is not None:
            self._send("commit", r.key, nodes)
        return self._round is None

    def restore_target(self) -> dict[str, Any]:
        """The committed snapshot a new generation restores ({"step": None, ...} when there is none).

        With none, the ranks read the newest persistent checkpoint. After training progressed, finding
        neither never restarts from step 0 silently: the target carries `must_restore` (why the ranks must
        fail rather than start over) unless fault_tolerance.restart_from_scratch allows it."""
        self.reporter.flush_metrics(force=True)
        self.reporter.settle_store()  # the rows just flushed count for the commit (not minutes: see there)
        self.commit()
        lookup_failed = None
        holders: Held = {}  # as the keepers answered just now
        if self.keepers:
            # Ask the keepers what they hold whole, not only what the acks say: acks are fire and forget,
            # and those sent while this supervisor was down (or restarting) or through an agent lost with
            # its node never came. A newer whole snapshot there is committed and restored.
            try:
                found, holders = self._newest_in_keepers()
                if found is not None and (self.committed is None or found > self.committed):
                    with self.run.lock:
                        self.committed = found
                        self.ever_committed = True
                        for k in [k for k in self._acks if k <= found]:
                            self._acks.pop(k)
            except Exception as e:  # noqa: BLE001 - said below, in must_restore
                lookup_failed = f"{type(e).__name__}: {e}"
                log.warning("asking the keepers for committed snapshots failed: %s", lookup_failed)
            self._asked_keepers = True
        if self.committed is not None:
            target = {"generation": self.committed[0], "step": self.committed[1]}
            if self.committed in holders:  # (world, {rank: nodes}): the ranks need not ask every keeper again
                target["known"] = holders[self.committed]
            return target
        target: dict[str, Any] = {"step": None, "generation": None}
        why = self._why_not_from_scratch(lookup_failed)
        if why is not None:
            target["must_restore"] = why
        return target

    def _newest_in_keepers(self) -> tuple[tuple[int, int] | None, Held]:
        """The newest snapshot the keepers hold whole, committed now if it was not yet, up to the last
        metrics row written (so a restore never skips a step whose row was lost). Else the keepers' newest
        committed one. After our own restart the rows are those of metrics.jsonl (and those the adopted
        workers gave back), so the steps the crashed instance's commit still trailed are not lost.
        Also returns what the keepers hold: {(generation, step): (world size, {rank: [nodes]})}."""
        from checkpointing.keepers import commit_snapshot, snapshot_holders

        holders, world, committed, _ = snapshot_holders(self.keepers, self.run.job_id)
        held = {k: (world[k], h) for k, h in holders.items() if k in world}
        newest = committed[-1] if committed else None
        # A restarted instance re-sends to the store the rows metrics.jsonl has (Reporter.open_outputs).
        first_after_restart = self.run.restarted and not self._asked_keepers
        rows = self.reporter.last_row_step if first_after_restart else self.reporter.committable_step
        for key in sorted(holders, reverse=True):
            if newest is not None and key <= newest:
                break
            # One live copy of each shard is enough here: the next generation reads it now, and a newer
            # whole snapshot beats an older one held twice (after a node loss, every snapshot since the
            # last commit has shards whose other copy went with the node).
            if key[1] <= rows and commit_snapshot(
                    self.keepers, self.run.job_id, key[0], key[1], world[key], min_copies=1):
                return (int(key[0]), int(key[1])), held
        return ((int(newest[0]), int(newest[1])) if newest is not None else None), held

    def _why_not_from_scratch(self, lookup_failed: str | None) -> str | None:
        """Why a restart from step 0 must not happen now (None: it may, e.g. before any state was due)."""
        run = self.run
        progressed = max(run.last_step_seen, self.reporter.last_row_step)
        if run.generation <= 0 or progressed <= 0 or run.ft.restart_from_scratch:
            return None
        ck = run.spec.checkpoint
        fix = ("set fault_tolerance.restart_from_scratch: true to allow a restart from step 0"
               + ("" if ck.in_memory_every or ck.persist_every else
                  ", or checkpoint.in_memory_every / persist_every to keep state"))
        if lookup_failed is not None:
            lost = f"the keepers could not be asked for a committed snapshot ({lookup_failed})"
        elif self.ever_committed or self.reporter.checkpoints_written:
            lost = "the state saved before (in-memory snapshot or persistent checkpoint) is gone"
        elif not ck.in_memory_every and not ck.persist_every:
            lost = "the job keeps no state (checkpoint.in_memory_every and persist_every are 0)"
        else:
            return None  # the failure came before the first save: starting over is all that is lost
        return (f"Training had reached step {progressed}, and no in-memory snapshot or persistent checkpoint "
                f"can be restored: {lost}. The job stops rather than restart from step 0; {fix}.")

    def fence(self, generation: int) -> None:
        """A new generation begins: the keepers refuse shards and commits of older ones (a stale worker
        still writing), and their acks here are dropped."""
        with self.run.lock:
            for k in [k for k in self._acks if k[0] < generation]:
                self._acks.pop(k)
        if self._round is not None and self._round.key[0] < generation:
            self._round = None  # its answers no longer matter (a keeper refuses an older generation's commit)
        if not self.keepers:
            return
        from checkpointing.keepers import fence_job

        try:
            fence_job(self.keepers, self.run.job_id, generation)
        except Exception as e:  # noqa: BLE001 - a keeper that is gone holds nothing stale
            log.warning("fencing generation %d on the keepers failed: %s", generation, e)

    def drop_job(self) -> int:
        """Free the job's keeper memory on every keeper of the cluster; the bytes freed.

        Not only the keepers this instance knows: a node written off (its agent fell silent, or Ray said
        it was gone) may live on with its keeper, and an instance that restarted never knew the keepers of
        nodes the job had left. Either would keep the job's shards until the keeper dies."""
        from checkpointing.keepers import drop_job, keepers_holding

        keepers = dict(self.keepers)
        try:
            keepers.update(keepers_holding(self.run.job_id, skip=keepers))
        except Exception as e:  # noqa: BLE001 - the known keepers are still freed
            log.warning("listing the cluster's keepers failed: %s", e)
        if not keepers:
            return 0
        with contextlib.suppress(Exception):
            return int(drop_job(keepers, self.run.job_id))
        return 0
