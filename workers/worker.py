"""The Ray actor that runs one rank of a job, generation after generation, in one process.

The supervisor creates it (`job-<id>/worker-<n>`, namespace unbroken, threaded so control calls
run while training blocks) and drives it:

    port = w.open_store(generation, world)       # on the generation's rank 0 only
    w.run(generation, rank, world, host, port, dp, ...)   # blocks until finished, paused or failed

`run` joins the group, builds a Trainer for the world size it is given (a new Trainer object in
the same process: no re-import, no restart; or, in the place it held in the last generation, the
last generation's own Trainer: workers.kept_trainer), loads the last committed state when told to, and
trains, pushing a heartbeat (generation, step, loss, timings) to the supervisor after every
step and from a side thread at least every `heartbeat_interval_s`. On any error it leaves the
group at once (so peers blocked in a collective with it fail fast too) and returns the error;
the worker then waits, alive and idle, for the next generation.

State tiers: the in-memory snapshot tier (keepers) when `checkpointing.snapshot` is available,
else snapshots through the persistent tier in a scratch root of the job; and persistent
checkpoints every `persist_every` steps. A restore takes the newest committed state of either.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from checkpointing.nodes import current_node_is_head, current_node_name
from parallel.layout_rules import engine_at_dp
from workers import telemetry
from workers.kept_trainer import KeptTrainer
from workers.protocol import (
    FaultNote,
    Formed,
    Heartbeat,
    Note,
    RunResult,
    RunStatus,
    SnapshotAck,
    StepReport,
)
from workers.train_loop import LoopHooks, train
from workers.warmup import freeze_heap, import_engine, open_checkpoint_store, warm_up
from workers.worker_tiers import Tiers, checkpoint_root, is_collective_error
from workers.zygote import CLIENT_ENV, FORKED_ENV

log = logging.getLogger("unbroken.worker")

# Metrics rows a worker keeps (its own, every rank's, the newest ones): a supervisor that restarts gets
# back the rows it never wrote from them (Worker.rows_after). Far more steps than a restart takes.
ROWS_KEPT = 4096


@dataclass
class WorkerOptions:
    """What a worker needs of the job spec beyond the engine config (plain data: no service import)."""

    job_id: str
    output_dir: str
    heartbeat_interval_s: float = 1.0
    collective_timeout_s: float = 30.0
    chaos: list[dict[str, Any]] = field(default_factory=list)
    device: str = "auto"
    replica: int = 0  # the supervisor's data-parallel replica this worker belongs to
    local: int = 0  # its place in the replica's tp x pp x cp group
    keep_trainer: bool = True  # fault_tolerance.keep_trainer


class Worker:
    def __init__(self, name: str, engine_json: str, ckpt_json: str, options: dict[str, Any], supervisor: Any) -> None:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        from workers.log_capture import SentLines, capture_process_output, echo_logs_to_stdout
        from workers.sigterm import exit_on_sigterm

        exit_on_sigterm()  # Ray's handler would never run in this threaded actor: see workers.sigterm

        self._output = capture_process_output()  # this process is the job's: its output goes to the job's logs
        self._sent_lines = SentLines()  # what a restarted supervisor asks back (lines_after)
        echo_logs_to_stdout()
        # The engine now, while the worker is starting, not inside the first generation.
        import_engine()
        from checkpointing.config import CheckpointConfig
        from parallel.config import EngineConfig

        self.name = name
        self.cfg = EngineConfig.model_validate_json(engine_json)
        self.ckpt_cfg = CheckpointConfig.model_validate_json(ckpt_json)
        self.opts = WorkerOptions(**options)
        self.supervisor = supervisor
        self._agent: Any = None  # this node's agent (workers.node_agent) once a generation names one
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node_name = current_node_name()  # from Ray: a keeper can be placed on any node
        self.on_head = current_node_is_head()
        self.pid = os.getpid()
        self.host = "127.0.0.1" if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0" else (
            ray.util.get_node_ip_address()
        )
        self._lock = threading.Lock()
        self._master_store: Any = None
        self._kept = KeptTrainer()  # a generation's trainer, for the next one in the same place
        self._abort_gen = -1  # generations up to this one must stop
        self._stop_at: tuple[int, int] | None = None  # (generation, step): pause after that step
        self.generation = -1
        self.rank = -1
        self.world_size = 0  # of the generation it last joined
        self.phase = "idle"
        self.step = 0
        self._last: StepReport | None = None
        self.max_step_time_s: float | None = None
        # step -> (generation, rank, metrics row) of the steps this worker completed, newest ROWS_KEPT: notes
        # are fire and forget, so rows sent while the supervisor was down are asked for again after its restart.
        self._rows: dict[int, tuple[int, int, dict[str, Any]]] = {}
        self._rows_lock = threading.Lock()
        self._acks: list[SnapshotAck] = []  # held snapshots not yet said (the next heartbeat carries them)
        self._acks_lock = threading.Lock()
        self._uploading: Callable[[], int | None] | None = None  # the generation's tiers': a save in flight
        from workers.chaos import Chaos

        self.chaos = Chaos(self.opts.chaos, is_head_node=lambda: self.on_head, on_fire=self._fired)
        self._hb_stop = threading.Event()
        threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()
        freeze_heap()

    # --- control calls (run in other actor threads while `run` blocks) ------------------------
    def info(self) -> dict[str, Any]:
        return {
            "name": self.name, "pid": self.pid, "node_id": self.node_id, "node_name": self.node_name,
            "host": self.host, "hostname": socket.gethostname(), "generation": self.generation,
            "rank": self.rank, "world_size": self.world_size, "phase": self.phase, "step": self.step,
            "replica": self.opts.replica, "local": self.opts.local,
            "forked": bool(os.environ.get(FORKED_ENV)),  # from its node's zygote (workers.zygote)
            # the process Ray started, which stands in for a forked worker (the worker's own pid otherwise)
            "ray_pid": int(os.environ.get(CLIENT_ENV) or self.pid),
        }

    def warm(self) -> dict[str, Any]:
        """Get ready outside any group, then answer `info` (the pool calls this once, at start): open the
        job's data (tokenized once per process, cached: parallel.data.corpus), build the model on the
        meta device (its code imported and traced once) and open its checkpoint store (an S3 client is
        made once per process), so a spare that joins a generation later only forms the group, shards and
        restores. A problem here is left to the start-up probe and the generation's own build to report
        with their reasons; `warm` in the answer says what happened."""
        t0 = time.perf_counter()
        warmed = warm_up(self.cfg, self._device(0))
        store_error = open_checkpoint_store(self.ckpt_cfg, checkpoint_root(self.ckpt_cfg, self.opts.output_dir))
        if store_error is not None:
            warmed["store_error"] = store_error
        freeze_heap()
        warmed["seconds"] = round(time.perf_counter() - t0, 3)
        return {**self.info(), "warm": warmed}

    def open_store(self, generation: int, world_size: int, timeout_s: float) -> int:
        """As the coming generation's rank 0: host its TCPStore on a fresh port; returns the port."""
        from workers.group import open_master_store

        with self._lock:
            self._master_store = open_master_store(self.host, world_size, timeout_s)
            return int(self._master_store.port)

    def probe(self) -> list[str]:
        """The start-up checks on this worker's node (workers.probe); [] when the job can start."""
        from workers.probe import probe_job

        return probe_job(self.cfg, self.ckpt_cfg, checkpoint_root(self.ckpt_cfg, self.opts.output_dir))

    def abort(self, generation: int) -> None:
        """Stop training in every generation up to `generation` at the next step boundary."""
        self._abort_gen = max(self._abort_gen, generation)
        from workers.group import abort_if_stuck, abort_rendezvous

        abort_rendezvous(generation)  # ranks still arriving or connecting leave now (one of them was lost)

        # NCCL: a rank blocked in a collective with a dead peer never reaches that boundary.
        abort_if_stuck(lambda: self.phase != "training" or self.generation > generation, grace_s=2.0)

    def aborted(self, generation: int) -> bool:
        """Whether `generation` was called off (abort): its ranks stop at the next step boundary."""
        return self._abort_gen >= generation

    def pause_at(self, generation: int, step: int) -> None:
        """Finish step `step` (and its snapshot), then return from `run` with status 'paused'."""
        self._stop_at = (generation, step)

    def rows_after(self, step: int) -> list[tuple[int, int, dict[str, Any]]]:
        """(generation, rank, metrics row) of the steps after `step` this worker completed, in step order.

        A restarted supervisor asks this of the workers it adopts: rank 0 sent these rows while it was
        down, and they were lost with it. Rows up to `step` are written already: they are let go."""
        with self._rows_lock:
            for s in [s for s in self._rows if s <= step]:
                del self._rows[s]
            return [self._rows[s] for s in sorted(self._rows)]

    def lines_after(self, newest: dict[str, float]) -> list[tuple[float, str, str, str]]:
        """(time, stream, line, source) of the output lines this worker sent that the job's logs lack:
        those newer than the newest line the logs hold of their source (`newest`). Like rows_after."""
        return self._sent_lines.after(newest)

    def _keep_row(self, generation: int, rank: int, row: dict[str, Any]) -> None:
        with self._rows_lock:
            self._rows[int(row["step"])] = (generation, rank, row)
            while len(self._rows) > ROWS_KEPT:
                del self._rows[min(self._rows)]

    def shutdown(self) -> None:
        self._hb_stop.set()
        from workers.group import leave_group

        leave_group()

    # --- notes to the supervisor (workers.protocol) ------------------------------------------
    def send(self, note: Note) -> Any:
        """Fire and forget: a missing supervisor must not stop training. Carries the output lines
        printed since the last note. Returns the call's ref (None where it could not be sent)."""
        note.logs = self._output.drain()
        if note.logs:
            self._sent_lines.add(note.source, note.logs)
        try:
            return (self._agent or self.supervisor).report.remote(note)
        except Exception:  # noqa: BLE001 - see above
            return None

    def ack(self, ack: SnapshotAck) -> None:
        """A snapshot's ack: a held one rides on the next heartbeat (the step's, or the side thread's within
        heartbeat_interval_s), a failed one goes at once."""
        if not ack.ok:
            self.send(ack)
            return
        with self._acks_lock:
            self._acks.append(ack)

    def _beat(self, metrics: dict[str, Any] | None = None) -> None:
        with self._acks_lock:
            acks, self._acks = self._acks, []
        uploading = None
        if (saving := self._uploading) is not None:
            with contextlib.suppress(Exception):  # (the tiers may be closing under this thread)
                uploading = saving()
        self.send(Heartbeat(self.name, self.generation, self.rank, time.time(), phase=self.phase, step=self.step,
                            pid=self.pid, last=self._last, metrics=metrics, acks=acks, uploading=uploading))

    def _heartbeat_loop(self) -> None:
        while not self._hb_stop.wait(self.opts.heartbeat_interval_s):
            self._beat()

    def _fired(self, fault: Any) -> None:
        """The fault's note reaches the supervisor (through this node's agent) before the process, or its
        node, may vanish: waited for, briefly, so a chaos fault does not stall its peers longer than a real one."""
        ref = self.send(FaultNote(self.name, self.generation, self.rank, time.time(), kind=fault.kind, step=self.step,
                                   at=fault.at))
        with contextlib.suppress(Exception):
            if self._agent is not None:
                ref = self._agent.sync.remote()
            if ref is not None:
                ray.wait([ref], timeout=FAULT_NOTE_S)

    # --- the run --------------------------------------------------------------------------------
    def run(
        self,
        generation: int,
        rank: int,
        world_size: int,
        host: str,
        port: int,
        dp: int,
        *,
        restore: dict[str, Any] | None,
        timeout_s: float,
        keepers: dict[str, Any] | None = None,
        agent: Any = None,
    ) -> RunResult:
        """Join generation `generation` as `rank`, restore, train to the end (or a pause, or an error).
        With `agent` (this node's, workers.node_agent), notes go to it, not to the supervisor."""
        import torch

        from workers.group import (
            RendezvousAborted,
            join_group,
            leave_group,
            sever_new_connections,
            socket_fds,
        )

        sockets_before = socket_fds()  # what is not in here when we fail belongs to the group
        # The last step this process trained, in a generation before this one: the survivor's own word on
        # how far a failed generation got, which its metrics rows may not have carried to the supervisor.
        trained_to = self.step
        place = (world_size, rank, dp)
        in_place = False
        self._agent = agent
        self.generation, self.rank, self.world_size = generation, rank, world_size
        self._last = None
        self.phase = "forming"
        timings: dict[str, float] = {}
        trainer = None
        tiers: Tiers | None = None
        try:
            t_formed = time.perf_counter()
            device = self._device(rank)
            master = self._master_store if rank == 0 else None
            # The node's ranks in this generation, from its agent: its lowest rank leads the node's part of
            # a two-level rendezvous (workers.group.rendezvous). Without an agent, every rank joins flat.
            local = ray.get(agent.local_ranks.remote(generation), timeout=60) if agent is not None else None
            info = join_group(generation, rank, world_size, host, port, device=device, timeout_s=timeout_s,
                              master_store=master, local_ranks=local,
                              on_connect=lambda: self.chaos.as_group_connects(rank, generation))
            timings["join_s"] = info.join_s
            t0 = time.perf_counter()
            # Kept only where a whole state will be loaded into it: a committed snapshot (or, failing
            # that, a persistent checkpoint); never where the restore may turn out "fresh".
            loads = restore is not None and restore.get("step") is not None and bool(keepers)
            trainer, in_place = self._kept.take(place, engine_at_dp(self.cfg, dp), device, restoring=loads)
            timings["build_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            tiers = Tiers(self, rank, world_size, timeout_s, keepers, trainer)
            self._uploading = tiers.uploading
            timings["tiers_s"] = time.perf_counter() - t0
            restored: dict[str, Any] = {"step": 0, "source": "fresh"}
            if restore is not None:
                t0 = time.perf_counter()
                restored = tiers.restore(trainer, restore, in_place=in_place)
                timings["restore_s"] = time.perf_counter() - t0
                timings.update(restored.pop("phases", {}))
                if generation > 0 and tiers.persist_every:
                    # A stale rank of an older generation may still be uploading: from here on its commit
                    # of a step past this resume point is refused (checkpointing.catalog's fences).
                    tiers.persistent.fence(generation, trainer.step)
            # Same process, same model and optimizer objects: what a layout-preserving re-form keeps.
            restored.update(in_place=in_place, pid=self.pid, model_id=id(trainer.model), trained_to=trained_to)
            self.step = trainer.step
            self.phase = "training"
            log.info("generation %d: rank %d of %d (dp=%d) on node %s, formed in %.2fs (%s); %s", generation,
                     rank, world_size, dp, self.node_name, time.perf_counter() - t_formed,
                     ", ".join(f"{k.removesuffix('_s')} {v:.3f}" for k, v in timings.items()),
                     f"restored step {restored['step']} from {restored['source']}" if restore is not None
                     else "starting from scratch")
            self.send(Formed(self.name, generation, rank, time.time(), step=trainer.step, restored=restored,
                             timings=timings))
            end = train(trainer, self.cfg, rank, self.opts.output_dir, _WorkerHooks(self, trainer, tiers, generation))
            result = RunResult(end.status, self.name, generation, rank, end.step, final=end.final)
        except RendezvousAborted as e:  # the generation was called off while it formed: no failure of ours
            log.info("%s", e)
            result = RunResult(RunStatus.ABORTED, self.name, generation, rank, self.step)
        except BaseException as e:  # noqa: BLE001 - reported to the supervisor, the process lives on
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            log.warning("generation %d, rank %d: %s: %s", generation, rank, type(e).__name__, str(e)[:500])
            result = RunResult(
                RunStatus.ERROR, self.name, generation, rank, trainer.step if trainer is not None else self.step,
                error=f"{type(e).__name__}: {e}"[:4000], collective=is_collective_error(e),
                traceback=traceback.format_exc()[-4000:], time=time.time(),
            )
        finally:
            with self._lock:
                self._master_store = None
        # Out of the except block (its traceback holds the frames that hold the trainer): drop every
        # reference to the group's objects, so destroying it really closes its sockets and peers
        # blocked on this rank see the error now, not at their timeout.
        ok = result.ok
        marks = [("", time.perf_counter())]  # (phase, its end): how long leaving took, for the log line
        if not ok:
            sever_new_connections(sockets_before)
        self._uploading = None
        if tiers is not None:
            tiers.close() if ok else tiers.abandon()
        if trainer is not None and result.status != RunStatus.FINISHED and self.opts.keep_trainer:
            self._kept.keep(place, trainer)  # detached from the group destroyed below
        trainer = tiers = None
        marks.append(("tiers", time.perf_counter()))
        gc.collect()
        marks.append(("gc", time.perf_counter()))
        leave_group(abort=not ok)  # NCCL: abort the communicators before destroying a broken group
        marks.append(("leave", time.perf_counter()))
        self.phase = "finished" if result.status == RunStatus.FINISHED else "idle"
        if self._acks:  # the last snapshots' acks (the steps' heartbeats are over), before the sync below
            self._beat()
        if self._agent is not None:  # the agent batches notes: this run's last ones go before its result
            with contextlib.suppress(Exception):
                # After a failure, briefly: the agent's upstream (a group leader) may be on the lost node,
                # and Ray takes 1-2 s to say so; the sync goes on without us, and an ack it brings too late
                # for the next restore costs a step replayed, not that wait.
                if ok:
                    ray.get(self._agent.sync.remote(), timeout=15)
                else:
                    ray.wait([self._agent.sync.remote()], timeout=FAILED_SYNC_S)
        marks.append(("sync", time.perf_counter()))
        if device_is_cuda():
            torch.cuda.empty_cache()
        if not ok:  # what a failed generation's survivors spend before the next can form
            log.info("generation %d: rank %d left its group in %.3fs (%s)", generation, rank,
                     marks[-1][1] - marks[0][1],
                     ", ".join(f"{k} {t - t0:.3f}" for (_, t0), (k, t) in zip(marks, marks[1:], strict=False)))
        return result

    def _device(self, rank: int) -> Any:
        import torch

        if self.opts.device == "cpu" or not torch.cuda.is_available():
            return torch.device("cpu")
        ids = ray.get_gpu_ids()
        return torch.device("cuda", 0 if ids else rank % torch.cuda.device_count())


FAILED_SYNC_S = 0.05  # how long a failed run waits for its agent to pass its last notes on
FAULT_NOTE_S = 0.5  # how long a chaos fault waits for its note to reach the supervisor


def device_is_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


class _WorkerHooks(LoopHooks):
    """The Ray worker's part of the train loop: abort and pause, chaos, telemetry, snapshots and
    checkpoints, heartbeats with the step's timings (rank 0's with its metrics row)."""

    def __init__(self, worker: Worker, trainer: Any, tiers: Tiers, generation: int) -> None:
        self.w, self.trainer, self.tiers, self.generation = worker, trainer, tiers, generation

    def stop_before_step(self) -> RunStatus | None:
        return RunStatus.ABORTED if self.w.aborted(self.generation) else None

    def before_step(self, done: int) -> None:
        self.w.chaos.before_step(done, self.w.rank, self.generation)

    def after_step(self, m: Any, gap_s: float) -> RunStatus | None:
        from workers.metrics_log import metrics_line

        w, trainer, steps = self.w, self.trainer, self.w.cfg.training.steps
        w.step = trainer.step
        w.max_step_time_s = max(w.max_step_time_s or 0.0, m.step_time_s)
        telemetry.record_step(w.opts.job_id, w.rank, m)
        block_s = self.tiers.after_step(trainer, self.generation)
        w._last = StepReport(trainer.step, gap_s, m.step_time_s, m.loss)
        row = metrics_line(m, generation=self.generation)
        # The checkpoint tiers' share of the training thread this step, and when the step ended
        # (wall-clock throughput includes what happens between steps; tokens_per_s does not).
        row["ckpt_block_s"] = block_s
        row["end_time"] = time.time()
        w._keep_row(self.generation, w.rank, row)  # every rank: any survivor can give it back (rows_after)
        metrics = None
        if w.rank == 0:
            metrics = row
            if trainer.step % w.cfg.training.log_every == 0 or trainer.step == steps:
                log.info("step %d/%d: loss %.4f, %.0f tokens/s, step %.3fs", trainer.step, steps, m.loss,
                         m.tokens_per_s, m.step_time_s)
        w._beat(metrics)
        stop = w._stop_at
        if stop is not None and stop[0] == self.generation and trainer.step >= stop[1]:
            self.tiers.wait()
            return RunStatus.PAUSED
        return None

    def before_final(self) -> None:
        self.tiers.wait()
