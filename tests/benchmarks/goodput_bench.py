"""Goodput under a seeded failure schedule: one 300-step job, run by Unbroken (without and with a spare),
Ray Train and TorchFT.

Same model and batches as the demo's job (our Llama, preset debug: dim 128 x 4 layers, byte vocab;
sequences of 128, 16 a step), same data order (our loader: each of 4 data
shards per step), same machine and a private 2-node LocalCluster (head + "b", 1 CPU each, which Ray
wants whole; ranks of 0.33 CPU: three a node, so the 4 ranks fit with room for one more, which only the
spare arm uses on purpose, and a node loss leaves room for 3). Each framework runs the job
fault-free, then with faults fired from outside, at times drawn from one seeded schedule (exponential
gaps, mean MEAN_GAP_S, counted from the run's first step), then fault-free again (all but Ray Train).
The job is the demo's so that its 300 steps last long enough to meet that rate: about 90 s fault-free on this VM's 2 cores, in which seed 2026 fires 6
faults of all four kinds (before e311bab, 2026-11-28, the job was a dim-64 x 2 model whose 300 steps lasted 15-20 s:
it met only the schedule's first, dense faults, one every 4-7 s, and never all four kinds):

  kill_worker     SIGTERM to the rank's process        sigkill_worker  SIGKILL to it
  hang_worker     SIGSTOP to it (only a heartbeat timeout can tell)
  kill_node       node b lost: for the Ray runs its raylet and every process on it (LocalCluster.kill_node);
                  for TorchFT (plain processes, no Ray) a SIMULATION: SIGKILL of the replicas placed on b.
                  The node's capacity returns NODE_BACK_S later.

- unbroken: a job through the supervisor (launch_supervisor), in-memory snapshots every step, no
  spares; dp shrinks on a loss and grows back when capacity returns. Its workers are forked from each
  node's zygote (resources.fork_workers, the default since 2026-11-29: workers.zygote).
- unbroken+spare: the same with resources.spares: 1 (a warm replica outside the group takes a lost
  rank's place at the next generation, so dp does not shrink while it lasts).
- raytrain: Ray Train V2 TorchTrainer, 4 workers, gloo, a DCP checkpoint reported every step,
  FailureConfig(max_failures=-1): every failure restarts the group from the last checkpoint. Its
  faulty run has a time cap (_raytrain_cap); past it the ranks stop and its ETTR is the rate measured
  up to then (said in the table's note).
- torchft: torchft 0.2.0 (the `bench` extra): its Rust lighthouse (100 ms quorum tick), 4 replica
  groups of one process each, gradients averaged over its gloo process group by the Manager, each
  replica healing from a live peer. Its gloo timeout is its best: the shortest of TORCHFT_TIMEOUTS
  whose fault-free run commits every step (no spurious failures). The restarter (torchelastic's
  role) restarts an exited replica at once and SIGKILLs one whose heartbeat file is HB_TIMEOUT_S stale.
  Its dead replicas' data shards are dropped for the steps they miss (its design), so its loss differs.

Per framework: ETTR = the fault-free time of the faulty run's steps / its wall (first to last completed
step). A step's fault-free time depends on how many ranks did it: on 2 cores, 3 ranks step faster than 4
(ours after a shrink; TorchFT after dropping a replica). So each step counts at its width: the
mean step time of the fault-free runs before and after the faulty one at the full width (full_width_s),
and at each narrower width the faulty run did steps at, the mean of a fault-free run held at that width
(ours: resources.dp fixed there; TorchFT: that many replica groups, each its usual data shard), run
after the faulty one. (Before 2026-11-28 the narrower
widths were timed by the faulty run's own steps there, which counted the slowdown beside replacement
workers' start-up as work.) Steps lost
(ours: replayed steps; Ray Train: steps re-run after restarts; TorchFT: step attempts not committed),
time lost per failure = (faulty wall - that fault-free time of its steps) / faults fired (so it
agrees with ETTR; a plain wall difference would count narrower, cheaper steps as time won), final
loss vs fault-free.
Run: .venv/bin/python -m tests.benchmarks.goodput_bench [--seed N] [--steps N] [--only ARM ...]
(`make bench` runs it with the defaults through tests.benchmarks.run_all.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")

STEPS = 300
MEAN_GAP_S = 20.0
KINDS = ("kill_worker", "sigkill_worker", "hang_worker", "kill_node")
NODE_BACK_S = 10.0  # a lost node's capacity returns after this
HB_TIMEOUT_S = 6.0  # missed heartbeats that mean a hang (ours and TorchFT's restarter alike)
COLLECTIVE_TIMEOUT_S = 10.0  # ours and Ray Train's gloo timeout
NODE_CPUS = 1  # head and b alike (Ray takes whole CPUs per node)
RANK_CPUS = 0.33  # three ranks a node: the 4 ranks and one spare fit on the two
ARMS = ("unbroken", "unbroken+spare", "torchft", "raytrain")
TORCHFT_TIMEOUTS = (1.0, 2.0, 5.0)
RAYTRAIN_CAP_X, RAYTRAIN_START_S = 1.5, 60.0  # Ray Train's faulty run stops past 1.5 x fault-free + 60 s
RAYTRAIN_GRACE_S = 120.0  # past the cap, the driver waits this long for the ranks to stop, then gives up
MODEL: dict[str, Any] = {"preset": "debug", "max_seq_len": 256}  # examples/demo_job.yaml's
TRAINING: dict[str, Any] = {"steps": STEPS, "seq_len": 128, "global_batch_size": 16, "warmup_steps": 5}
WORLD = 4


@dataclass
class Fault:
    at_s: float  # after the run's first completed step
    kind: str
    rank: int


def schedule(seed: int, horizon_s: float = 1800.0) -> list[Fault]:
    rng = random.Random(seed)
    out, t, kinds = [], 0.0, []
    while True:
        t += rng.expovariate(1.0 / MEAN_GAP_S)
        if t > horizon_s:
            return out
        if not kinds:  # every kind once per four faults, in a random order: a mix at any length
            kinds = rng.sample(KINDS, len(KINDS))
        out.append(Fault(round(t, 2), kinds.pop(), rng.randrange(WORLD)))


@dataclass
class Outcome:
    wall_s: float
    steps: list[tuple[int, float, float]]  # (step, time, loss) of each step counted once
    lost_steps: int
    fired: list[str] = field(default_factory=list)
    detail: list[str] = field(default_factory=list)  # per-recovery lines, where the framework says
    stopped: str = ""  # why the run stopped before its last step (the bench's time cap), else ""
    # Per step (as `steps`): (ranks or replicas that did it, generation); None: all WORLD, one generation.
    widths: list[tuple[int, int]] | None = None
    # Ours: each pause between generations (the step that ended one to the next one's first, less a step).
    pauses_s: list[float] = field(default_factory=list)

    @property
    def final_loss(self) -> float:
        return self.steps[-1][2]


@dataclass
class Arm:
    free: Outcome
    faulty: Outcome
    note: str
    at_width: dict[int, float] = field(default_factory=dict)  # fault-free step s of runs held at a narrower width
    # The same fault-free run again, right after the faulty one (not for Ray Train): see full_width_s.
    free_after: Outcome | None = None


class Injector:
    """Fires the schedule at one run: `pids()` -> {rank: pid} of its live ranks; `kill_node()` / `node_back()`."""

    def __init__(self, faults: list[Fault], pids: Any, kill_node: Any, node_back: Any, first_step: Any) -> None:
        self.faults, self.pids, self.kill_node, self.node_back = faults, pids, kill_node, node_back
        self.first_step = first_step  # () -> time of the first completed step, or None
        self.fired: list[str] = []
        self.stopped: list[int] = []  # SIGSTOPped pids (SIGKILLed at the end if still there)
        self.node_back_at: float | None = None  # node_back() runs on the main thread (tick): Ray's add_node
        # installs signal handlers, which only the main thread may do
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (t0 := self.first_step()) is None:
            if self._stop.wait(0.2):
                return
        node_down_until = 0.0
        for f in self.faults:
            if self._stop.wait(max(0.0, t0 + f.at_s - time.time())):
                return
            if f.kind == "kill_node":
                if time.time() < node_down_until:
                    continue  # node b is already down: nothing to lose
                self.kill_node()
                node_down_until = time.time() + NODE_BACK_S
                self.node_back_at = time.time() + NODE_BACK_S
                self.fired.append(f"{f.at_s:.0f}s kill_node")
                continue
            live = self.pids()
            if not live:
                continue
            rank = f.rank if f.rank in live else sorted(live)[f.rank % len(live)]
            pid = live[rank]
            sig = {"kill_worker": signal.SIGTERM, "sigkill_worker": signal.SIGKILL, "hang_worker": signal.SIGSTOP}
            try:
                os.kill(pid, sig[f.kind])
            except ProcessLookupError:
                continue
            if f.kind == "hang_worker":
                self.stopped.append(pid)
            self.fired.append(f"{f.at_s:.0f}s {f.kind} rank {rank}")

    def tick(self) -> None:
        """On the main thread, often: bring a lost node back when its time has come."""
        if self.node_back_at is not None and time.time() >= self.node_back_at:
            self.node_back_at = None
            self.node_back()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for pid in self.stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def projected_ettr(lost_per_fault_s: float, mean_gap_s: float = MEAN_GAP_S) -> float:
    """ETTR at one fault per `mean_gap_s` if each costs `lost_per_fault_s` (what the run measured)."""
    return max(0.0, 1.0 - lost_per_fault_s / mean_gap_s)


def _wall(steps: list[tuple[int, float, float]]) -> float:
    return steps[-1][1] - steps[0][1]


def step_s(free: Outcome) -> float:
    """A fault-free run's mean step time."""
    return _wall(free.steps) / max(1, len(free.steps) - 1)


def narrower_widths(faulty: Outcome) -> list[int]:
    """The widths below WORLD the faulty run did steps at (each gets a fault-free run held there)."""
    return sorted({w for w, _ in faulty.widths or [] if w < WORLD})


def full_width_s(arm: Arm) -> float:
    """The fault-free step time at WORLD: the mean of the fault-free runs before and after the faulty
    one. This VM's share of its host drifts within a run (on 2026-11-29 a fault-free run on a faster
    share than the faulty run after it put 2-3% a step into "lost" time); timing the baseline on both
    sides of the faulty run cancels a steady drift."""
    runs = [arm.free] + ([arm.free_after] if arm.free_after else [])
    return sum(step_s(r) for r in runs) / len(runs)


def productive_s(arm: Arm) -> tuple[float, dict[int, float]]:
    """The fault-free time of the faulty run's steps, each at the width it ran at, and the step time
    used per width: the fault-free runs' mean at WORLD (full_width_s), a fault-free run's held there below it."""
    per = {**arm.at_width, WORLD: full_width_s(arm)}
    widths = arm.faulty.widths or [(WORLD, 0)] * len(arm.faulty.steps)
    return sum(per[w] for w, _ in widths[1:]), per


# ---------------------------------------------------------------------------- unbroken
def _ours_spec(out: Path, spares: int = 0, dp: int | None = None, *, parallelism: dict[str, Any] | None = None,
               in_memory_every: int = 1) -> Any:
    """The job; `dp`: held at that width (a fault-free run at a narrower width), else elastic 1..WORLD.
    `parallelism` and `in_memory_every` change the layout and the snapshots (step_gap_bench)."""
    from service.spec import parse_spec

    return parse_spec({
        "name": "goodput", "model": MODEL, "training": {**TRAINING, "output_dir": str(out)},
        "parallelism": parallelism or {"dp_shard": WORLD},
        "resources": {"cpus_per_worker": RANK_CPUS, "dp": {"min": dp or 1, "max": dp or WORLD},
                      "spares": spares},
        "checkpoint": {"persist_every": 0, "in_memory_every": in_memory_every},
        "fault_tolerance": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": HB_TIMEOUT_S,
                            "collective_timeout_s": COLLECTIVE_TIMEOUT_S, "wait_for_capacity_s": 60,
                            "max_recoveries": 100},
    })  # fmt: skip


def run_ours(tmp: Path, cluster: Any, faults: list[Fault], spares: int = 0, dp: int | None = None,
             **spec: Any) -> Outcome:
    """`spec`: _ours_spec's keyword arguments (another layout, other snapshots)."""
    from service.supervisor.pauses import PauseClock
    from tests.runtime.jobs import JobRun, worker_infos

    run = JobRun(_ours_spec(tmp, spares, dp, **spec))
    metrics = tmp / "metrics.jsonl"

    def first_step() -> float | None:
        if not metrics.exists() or not metrics.read_text().strip():
            return None
        return float(json.loads(metrics.read_text().splitlines()[0])["end_time"])

    def pids() -> dict[int, int]:
        """The ranks of the newest generation that trains. A rank of an older one can still say
        "training" (stuck in a collective the failure broke) and a spare trains in none: neither is a
        target, as a fault there would cost the job nothing."""
        found = [i for i in worker_infos(run.job_id) if i["phase"] == "training" and i["rank"] >= 0]
        newest = max((int(i["generation"]) for i in found), default=-1)
        return {int(i["rank"]): int(i["pid"]) for i in found if int(i["generation"]) == newest}

    inj = Injector(faults, pids, lambda: _kill_node_b(cluster), lambda: _node_b_back(cluster),
                   first_step) if faults else None
    deadline = time.monotonic() + 1800
    try:
        while True:
            if inj is not None:
                inj.tick()
            try:
                st = run.wait(timeout_s=1.0)
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise
    finally:
        if inj is not None:
            inj.stop()
        run.finish()
        _ensure_node_b(cluster)
    if st["state"] != "SUCCEEDED":
        tb = next((e["data"].get("traceback") or "" for e in run.events if e["kind"] == "failed"), "")
        kinds = Counter(e["kind"] for e in run.events)
        kept = Path(tempfile.gettempdir()) / f"goodput-{run.job_id}-events.json"  # outlives the run's folder
        kept.write_text(json.dumps(run.events, default=str, indent=1))
        raise RuntimeError(f"(its events: {kept}) "
                           f"unbroken job ended {st['state']}: {st.get('reason')}; supervisor traceback: "
                           f"{tb[-1500:]}; events by kind: {dict(kinds)}")
    rows = run.rows()
    (tmp / "events.json").write_text(json.dumps(run.events, default=str, indent=1))  # beside its metrics
    steps = [(int(r["step"]), float(r["end_time"]), float(r["loss"])) for r in rows]
    lost = sum(int(e["data"].get("lost_steps") or 0) for e in run.of("recovered"))
    _ensure_node_b(cluster)
    # An event's message is clipped (a failure's may carry a traceback); the lines computed below are printed whole.
    detail = [f"{e['kind']}: {e.get('message', '')}"[:300] for e in run.events
              if e["kind"] in ("recovered", "spare_swapped", "resized", "recovery_interrupted")]
    # The pauses by the supervisor's own rule (service.supervisor.pauses: its recovered and resumed events').
    at = {int(r["step"]): i for i, r in enumerate(rows)}
    changes = [(rows[at[p.step] - 1], p) for p in PauseClock().rows(rows)]
    detail.append("pauses (the step that ended each generation to the next one's first, less a step): " + ", ".join(
        f"g{a['generation']}->g{p.generation} dp {a['dp']}->{p.dp} {p.seconds:.2f}s" for a, p in changes))
    by_dp = Counter(int(r["dp"]) for r in rows)  # a step's time depends on dp here (2 cores for 4 ranks)
    detail.append("steps by dp: " + ", ".join(f"dp {k}: {v}" for k, v in sorted(by_dp.items(), reverse=True)))
    widths = [(int(r["dp"]), int(r["generation"])) for r in rows]
    return Outcome(_wall(steps), steps, lost, inj.fired if inj else [], detail, widths=widths,
                   pauses_s=[p.seconds for _, p in changes])


def _kill_node_b(cluster: Any) -> None:
    if "b" in cluster.nodes:
        cluster.kill_node("b")


def _node_b_back(cluster: Any) -> None:
    if "b" not in cluster.nodes:
        cluster.add_node("b", num_cpus=NODE_CPUS)


def _ensure_node_b(cluster: Any) -> None:
    """Node b back before the next run (a kill_node near the end may have left it down)."""
    deadline = time.time() + NODE_BACK_S + 5
    while "b" not in cluster.nodes and time.time() < deadline:
        time.sleep(0.5)
    if "b" not in cluster.nodes:
        cluster.add_node("b", num_cpus=NODE_CPUS)


# ---------------------------------------------------------------------------- Ray Train
def run_raytrain(tmp: Path, cluster: Any, faults: list[Fault], cap_s: float | None = None) -> Outcome:
    """`cap_s`: stop at the first step boundary that many seconds after fit() starts (none: no cap)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from tests.benchmarks._raytrain_runner import train_loop
    from tests.runtime.jobs import engine_of

    tmp.mkdir(parents=True)
    engine = json.loads(engine_of(_ours_spec(tmp / "out")).model_dump_json())
    log, pid_dir = tmp / "steps.jsonl", tmp / "pids"
    pid_dir.mkdir()
    (tmp / "ckpt").mkdir()

    def first_step() -> float | None:
        return float(json.loads(log.read_text().splitlines()[0])["time"]) if log.exists() and log.read_text() else None

    def pids() -> dict[int, int]:
        out = {}
        for f in pid_dir.iterdir():
            pid = int(f.read_text())
            try:
                os.kill(pid, 0)
                out[int(f.name)] = pid
            except (ProcessLookupError, PermissionError):
                pass
        return out

    inj = Injector(faults, pids, lambda: _kill_node_b(cluster), lambda: _node_b_back(cluster),
                   first_step) if faults else None
    deadline = time.time() + (cap_s if cap_s is not None else 1e6)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"engine": engine, "log": str(log), "ckpt_root": str(tmp / "ckpt"),
                           "pid_dir": str(pid_dir), "deadline": deadline},
        torch_config=TorchConfig(backend="gloo", timeout_s=int(COLLECTIVE_TIMEOUT_S)),
        scaling_config=ScalingConfig(num_workers=WORLD, resources_per_worker={"CPU": RANK_CPUS}),
        run_config=RunConfig(name=f"goodput-{tmp.name}", storage_path=str(tmp / "storage"),
                             failure_config=FailureConfig(max_failures=-1),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)),
    )
    errors: list[BaseException] = []

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
            errors.append(e)

    fitting = threading.Thread(target=fit, daemon=True)
    fitting.start()
    given_up: float | None = None  # when the driver stopped waiting for a run past its cap
    try:
        while fitting.is_alive():  # the main thread brings lost nodes back
            if inj is not None:
                inj.tick()
                if time.time() > deadline:  # past the cap: no more faults while the ranks stop
                    inj.stop()
            if time.time() > deadline + RAYTRAIN_GRACE_S:
                # No group reached a step boundary since the cap (each restart still starting, or
                # waiting for capacity): the ranks' check never runs. Stop waiting; the cluster's
                # teardown stops its actors.
                given_up = time.time()
                break
            fitting.join(0.5)
        if errors:
            raise errors[0]
    finally:
        if inj is not None:
            inj.stop()
        _ensure_node_b(cluster)
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    entries = [e for e in lines if "stopped" not in e]
    stop = next((e for e in lines if "stopped" in e), None)
    seen: dict[int, tuple[int, float, float]] = {}
    for e in entries:  # a step re-run after a restart: its last run counts, the earlier ones were lost
        seen[int(e["step"])] = (int(e["step"]), float(e["time"]), float(e["loss"]))
    steps = [seen[s] for s in sorted(seen) if stop is None or s <= int(stop["step"])]  # past the restored
    # step at the stop: done once, then lost to the last restart
    _ensure_node_b(cluster)
    end = float(stop["stopped"]) if stop else given_up or steps[-1][1]
    why = (f"stopped at the cap ({cap_s:.0f}s after the start) after step {stop['step']} of {STEPS}"
           if stop else "")
    if stop is None and given_up is not None:
        why = (f"no step boundary within {RAYTRAIN_GRACE_S:.0f}s past the cap ({cap_s:.0f}s after the start); "
               f"given up after step {steps[-1][0] if steps else 0} of {STEPS}")
    return Outcome(end - entries[0]["time"], steps, len(entries) - len(seen), inj.fired if inj else [], stopped=why)


def _raytrain_cap(free: Outcome | None) -> float | None:
    """The faulty run's time cap: RAYTRAIN_CAP_X x its fault-free wall plus the group's start-up. With a
    checkpoint every step and a restart per failure it may not finish 300 steps at this failure rate
    before faults stop coming (the schedule's horizon). Past the cap its ETTR is the rate measured over
    the time it ran (the fault-free time of the steps it did / elapsed); only an ETTR under about
    1 / RAYTRAIN_CAP_X gets cut so."""
    return None if free is None else RAYTRAIN_CAP_X * free.wall_s + RAYTRAIN_START_S


# ---------------------------------------------------------------------------- TorchFT
from tests.benchmarks._torchft_runner import run_torchft, run_torchft_width  # noqa: E402


# ---------------------------------------------------------------------------- report
def set_job(steps: int, model: dict[str, Any], seq_len: int, batch: int) -> tuple[int, dict[str, Any], int, int]:
    """Change the job every arm runs (the short test runs a smaller one); returns the one it replaced."""
    global STEPS
    before, model = (STEPS, dict(MODEL), TRAINING["seq_len"], TRAINING["global_batch_size"]), dict(model)
    STEPS = steps
    MODEL.clear()  # in place: the runners read it by name
    MODEL.update(model)
    TRAINING.update(steps=steps, seq_len=seq_len, global_batch_size=batch)
    return before


def measure(names: list[str], faults: list[Fault], tmp: Path | None = None) -> tuple[dict[str, Arm], dict[str, str]]:
    """Each named arm fault-free, then under `faults`, on one private 2-node LocalCluster. Returns the
    arms that ran ({name: Arm}, each with its fault-free runs at the narrower widths its faulty run
    did steps at) and why the others did not. Progress is printed.
    `tmp`: keep each run's folder there (else a temporary one)."""
    from service.local_cluster import LocalCluster

    res: dict[str, Arm] = {}
    why: dict[str, str] = {}  # arms that did not run, and why
    with tempfile.TemporaryDirectory(prefix="goodput_bench_") as d, \
            LocalCluster(head_cpus=NODE_CPUS, object_store_mb=300) as cluster:  # fmt: skip
        root = tmp or Path(d)
        cluster.add_node("b", num_cpus=NODE_CPUS)
        cluster.connect()
        # (run dir, faults, the arm's fault-free outcome or None) -> (outcome, note)
        held_at = {  # (run dir, width) -> a fault-free outcome held at that width
            "unbroken": lambda p, w: run_ours(p, cluster, [], dp=w),
            "torchft": lambda p, w: run_torchft_width(p, w),
        }
        family = {"unbroken": "unbroken", "unbroken+spare": "unbroken", "torchft": "torchft"}  # (Ray Train: never narrower)
        measured: dict[tuple[str, int], float] = {}  # ours with and without spares share them
        runners = {"unbroken": lambda p, f, _: (run_ours(p, cluster, f), ""),
                   "unbroken+spare": lambda p, f, _: (run_ours(p, cluster, f, spares=1), "spares: 1"),
                   "raytrain": lambda p, f, free: (run_raytrain(p, cluster, f, _raytrain_cap(free)), ""),
                   "torchft": lambda p, f, _: run_torchft(p, f, TORCHFT_TIMEOUTS)}
        for name in names:
            try:
                free, note = runners[name](root / f"{name}-free", [], None)
                print(f"  {name}: fault-free {free.wall_s:.1f}s (load average {os.getloadavg()[0]:.1f})", flush=True)
                faulty, _ = runners[name](root / f"{name}-faulty", faults, free)
                print(f"  {name}: faulty {faulty.wall_s:.1f}s (load average {os.getloadavg()[0]:.1f}); fired: "
                      f"{'; '.join(faulty.fired)}", flush=True)
                for line in faulty.detail:
                    print(f"    {line}", flush=True)
                arm = Arm(free, faulty, note)
                if name != "raytrain":  # its fault-free run lasts ~10 min and its ETTR is ~0.25: drift is noise there
                    # The fault-free run's own settings (TorchFT: the timeout its calibration chose, not a new one).
                    after = root / f"{name}-free-after"
                    arm.free_after = (run_torchft_width(after, WORLD) if name == "torchft"
                                      else runners[name](after, [], None)[0])
                    print(f"  {name}: fault-free again {arm.free_after.wall_s:.1f}s "
                          f"({step_s(free):.3f} then {step_s(arm.free_after):.3f}s a step)", flush=True)
                fam = family.get(name)
                for w in narrower_widths(faulty) if fam else []:
                    if (fam, w) not in measured:
                        measured[fam, w] = step_s(held_at[fam](root / f"{fam}-free-w{w}", w))
                        print(f"  {fam}: fault-free at width {w}: {measured[fam, w]:.3f}s a step", flush=True)
                    arm.at_width[w] = measured[fam, w]
                res[name] = arm  # (only whole: an arm whose width run failed is in `why` alone)
            except Exception as e:  # noqa: BLE001 - still print the others
                why[name] = f"{type(e).__name__}: {str(e)[:2500]}"
                print(f"  {name} failed: {why[name]}", flush=True)
    return res, why


def ettr_of(arm: Arm) -> tuple[float, float, dict[int, float]]:
    """(ETTR, time lost per fault fired, the step time used per width) of one arm."""
    productive, per = productive_s(arm)
    faulty = arm.faulty
    return productive / faulty.wall_s, (faulty.wall_s - productive) / max(1, len(faulty.fired)), per


def report(res: dict[str, Arm], why: dict[str, str], faults: list[Fault]) -> dict[str, str]:
    """Print the table and its last line (`goodput: ...`); returns {arm: ETTR as printed}."""
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    print(f"{'':<16}{'ETTR':>6}{'faults':>8}{'gap s':>7}{'ETTR@gap':>10}{'steps lost':>12}{'s lost/fault':>14}"
          f"{'final loss':>12}{'fault-free':>12}{'wall s':>9}{'free s':>8}  note")
    ettr: dict[str, str] = {}
    split: list[str] = []  # the lost-time lines, printed under the table
    for name, arm in res.items():
        free, faulty, note = arm.free, arm.faulty, arm.note
        n = max(1, len(faulty.fired))
        # The fault-free time of the work the faulty run got done (all of it, unless it hit the cap),
        # each step at the width it ran at.
        e, per_fault, per = ettr_of(arm)
        if arm.free_after:
            note = (f"{note}; fault-free step s at {WORLD} before / after the faulty run: "
                    f"{step_s(free):.3f} / {step_s(arm.free_after):.3f}").lstrip("; ")
        if len(per) > 1:
            note = (f"{note}; fault-free step s by width: "
                    + ", ".join(f"{w}: {t:.3f}" for w, t in sorted(per.items(), reverse=True))).lstrip("; ")
        ettr[name] = f"{e:.2f}"
        if faulty.pauses_s:  # where our lost time went: the pauses, and steps slower than fault-free ones
            lost, pauses = per_fault * n, sum(faulty.pauses_s)
            split.append(f"lost time: {name} {lost:.1f} s = {pauses:.1f} s in {len(faulty.pauses_s)} pauses + "
                         f"{lost - pauses:.1f} s in steps slower than fault-free ones at their width (beside "
                         "starting workers and a returning node on the same cores)")
        if faulty.stopped:
            note = f"{note}; {faulty.stopped}: ETTR = fault-free time of the steps done / elapsed".lstrip("; ")
        print(f"{name:<16}{e:>6.2f}{len(faulty.fired):>8}{faulty.wall_s / n:>7.1f}"
              f"{projected_ettr(per_fault):>10.2f}{faulty.lost_steps:>12}"
              f"{per_fault:>14.2f}{faulty.final_loss:>12.4f}{free.final_loss:>12.4f}"
              f"{faulty.wall_s:>9.1f}{free.wall_s:>8.1f}  {note}")
    for name, reason in why.items():
        print(f"{name:<16}{'n/a':>6}  {reason[:300]}")
    print(f"gap s: the faulty run's wall per fault fired, the failure rate it met (the schedule's first faults "
          f"come {', '.join(f'{f.at_s:.0f}' for f in faults[:3])} s in; its mean gap is {MEAN_GAP_S:.0f} s). "
          f"ETTR@gap is a PROJECTION, not a measurement: 1 - s lost per fault / {MEAN_GAP_S:.0f} s, this run's cost "
          "of a fault at the schedule's mean rate (a run as short as the fault-free one meets fewer, denser faults)")
    for name, arm in res.items():
        free, faulty = arm.free, arm.faulty
        if faulty.wall_s < free.wall_s:  # say so: the width-weighted ETTR above is the one to read
            print(f"note: {name}'s faulty run took less time than its fault-free one: with fewer ranks than "
                  f"{WORLD} sharing {os.cpu_count()} cores (ours: a shrunk dp, see its steps by dp; TorchFT: "
                  "dropped replicas' shards) a step is cheaper here; its ETTR counts each step at its width")
    for line in split:
        print(line)
    print("goodput: " + ", ".join(f"{name} {ettr.get(name, 'n/a')}" for name in ARMS))
    return ettr


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--only", nargs="*", default=list(ARMS), choices=ARMS)
    ap.add_argument("--steps", type=int, default=STEPS, help=f"job length (the benchmark's is {STEPS})")
    ap.add_argument("--keep", type=Path, default=None,
                    help="keep each run's folder (metrics.jsonl, events) under this folder, for a closer look")
    args = ap.parse_args([] if argv is None else argv)
    set_job(args.steps, MODEL, TRAINING["seq_len"], TRAINING["global_batch_size"])
    faults = schedule(args.seed)
    print(f"load average {os.getloadavg()[0]:.1f} at start")
    print(f"{STEPS} steps of model {MODEL}, sequences of {TRAINING['seq_len']}, {TRAINING['global_batch_size']} a step, "
          f"4 ranks on a 2-node LocalCluster ({os.cpu_count()} cores); faults (seed {args.seed}, "
          f"mean gap {MEAN_GAP_S:.0f}s): " + ", ".join(f"{f.at_s:.0f}s {f.kind}@{f.rank}" for f in faults[:8]) + " ...")
    res, why = measure(args.only, faults, args.keep)
    report(res, why, faults)


if __name__ == "__main__":
    import sys

    # One instance of this module (the TorchFT runner imports it by name and reads STEPS/TRAINING).
    from tests.benchmarks import goodput_bench

    goodput_bench.main(sys.argv[1:])
