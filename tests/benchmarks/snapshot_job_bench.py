"""Snapshot cost where users live: a job through the supervisor, `in_memory_every: 1` against `0`.

The same spec (2 workers, FSDP, one on each node of a private 2-node LocalCluster, keepers on both:
every shard is copied to its own node's keeper and the other node's) run as separate jobs through
`launch_supervisor`, alternating none/snap/snap/none... so load from other work on a shared machine
falls on both. Per preset (debug, small):

- tokens/s by wall clock over each job's steady steps (from the rows' `end_time`: what happens between
  steps, the snapshot hand-over included, counts; the engine's own tokens_per_s would not see it);
  the ratio snap/none is the median over adjacent pairs. Goal >= 0.97.
- the training thread's blocking time per step for the checkpoint tiers (`ckpt_block_s` in each
  metrics row: the optimizer step's wait for a copy still in flight, plus the hand-over after the step).
- the CPU time per steady step of every Ray process on the machine (the cluster is the bench's own), by
  kind: workers, keepers, node agents, supervisor, and Ray's own daemons. On 2 cores every CPU-second
  the snapshot path spends is taken from training, so this is the cost itself, steadier than wall-clock
  tokens/s when the machine's share of its host varies.
- optionally (`--threads`) that CPU for the workers and keepers split by thread: training, the snapshot's
  copier and sender, the keeper's stream and main threads, the rest (gloo, Ray's own) - named by py-spy
  (which Ray installs), read from /proc. It shows what each part of the snapshot path costs, and how
  much slower the training thread itself runs beside it.
- optionally (`--tcp`) an arm whose copy to its own node's keeper goes over the socket rather than
  shared memory (`checkpoint.snapshot_shared_memory: false`), and (`--persist N`) an arm with a
  persistent checkpoint every N steps as well (file://).

Run: .venv/bin/python -m tests.benchmarks.snapshot_job_bench [--presets debug small] [--rounds 3]
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")

STEPS = {"debug": 60, "small": 30}
WARM = {"debug": 10, "small": 6}  # steps left out of the steady window (start-up, first snapshots)


def _spec(out: Path, preset: str, ckpt: dict[str, Any]) -> Any:
    from service.spec import parse_spec

    return parse_spec({
        "name": f"snapjob-{preset}", "model": {"preset": preset},
        "training": {"steps": STEPS[preset], "seq_len": 128, "global_batch_size": 8, "warmup_steps": 2,
                     "output_dir": str(out)},
        "parallelism": {"dp_shard": 2},
        "resources": {"cpus_per_worker": 1, "dp": {"min": 2, "max": 2}},
        "checkpoint": {"persist_every": 0, **ckpt},
        "fault_tolerance": {"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 60, "collective_timeout_s": 60},
    })  # fmt: skip


_KINDS = {"Worker": "workers", "Keeper": "keepers", "NodeAgent": "agents", "Supervisor": "supervisor"}


def ray_cpu_s() -> dict[int, tuple[str, float]]:
    """pid -> (kind, CPU seconds so far) of this machine's Ray processes, from /proc; kind: the actor
    class, else "ray" (GCS, raylets, dashboard, Ray's agents)."""
    from tests.benchmarks.api_bench import cpu_seconds

    out: dict[int, tuple[str, float]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if cmd.startswith("ray::"):  # ray::<Class>.<method>, or ray::job-<id>/worker-<n>:<Class>.<method>
            kind = _KINDS.get(cmd.split(" ", 1)[0].rsplit(":", 1)[-1].split(".", 1)[0], "ray")
        elif "ray" in cmd and ("gcs_server" in cmd or "raylet" in cmd or "dashboard" in cmd):
            kind = "ray"
        else:
            continue
        cpu = cpu_seconds(int(d.name))
        if cpu == cpu:  # NaN: it exited meanwhile
            out[int(d.name)] = (kind, cpu)
    return out


# A Python thread's name prefix -> its role in --threads; the training thread is found by its stack.
_ROLES = (("snapshot-copy", "copier"), ("snapshot-r", "sender"), ("shard-stream", "stream"),
          ("heartbeat", "heartbeat"), ("MainThread", "main"))
_DUMP = re.compile(r'^Thread (\d+) \([^)]*\): "([^"]*)"', re.MULTILINE)


def thread_roles(pid: int) -> dict[int, str]:
    """tid -> role of a process's Python threads (py-spy dump, not pausing it); a thread whose stack is in
    Worker.run is "training". Threads Python does not know (gloo's, Ray's) are not in it."""
    spy = Path(sys.executable).with_name("py-spy")
    try:
        out = subprocess.run([str(spy), "dump", "--nonblocking", "-p", str(pid)], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    heads = list(_DUMP.finditer(out))
    roles: dict[int, str] = {}
    for i, m in enumerate(heads):
        stack = out[m.end(): heads[i + 1].start() if i + 1 < len(heads) else len(out)]
        role = next((r for prefix, r in _ROLES if m.group(2).startswith(prefix)), "other")
        roles[int(m.group(1))] = "training" if "Worker.run" in stack else role
    return roles


def thread_cpu_s(pids: list[int]) -> dict[tuple[int, int], float]:
    """(pid, tid) -> CPU seconds so far of every thread of these processes (/proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[tuple[int, int], float] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError, IndexError, ValueError):
                    f = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
                    out[(pid, int(tid))] = (int(f[11]) + int(f[12])) / tick
    return out


def cpu_between(c0: dict[int, tuple[str, float]], c1: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds by kind spent between two ray_cpu_s() readings, by the processes alive at both (an
    earlier job's workers still exiting at the first are not this job's)."""
    out: dict[str, float] = {}
    for pid, (kind, t1) in c1.items():
        if pid in c0 and c0[pid][0] == kind:
            out[kind] = out.get(kind, 0.0) + t1 - c0[pid][1]
    return out


def step_position(ends: list[float], t: float) -> float:
    """How many steps were done at time t, by linear interpolation between the steps' end times (sorted):
    a CPU reading between two step ends counts the part of the step in progress."""
    i = bisect.bisect_right(ends, t)
    if i == 0 or i == len(ends):
        return float(i)
    return i + (t - ends[i - 1]) / max(ends[i] - ends[i - 1], 1e-9)


def _job(out: Path, preset: str, ckpt: dict[str, Any], threads: bool = False) -> dict[str, Any]:
    """One job to the end; its steady wall-clock tokens/s, blocking times and CPU per steady step (and,
    with `threads`, the workers' and keepers' CPU per steady step by thread role)."""
    from tests.runtime.jobs import JobRun

    run = JobRun(_spec(out, preset, ckpt), job_id=f"sjb-{uuid.uuid4().hex[:6]}")
    # CPU readings with their times: a row reaches the store up to a second after its step ended (the
    # agents batch them), so the window is placed by the steps' own end times, not by when rows arrive.
    readings: list[tuple[float, dict[int, tuple[str, float]]]] = []
    per_thread: list[dict[tuple[int, int], float]] = []  # beside each reading, with --threads
    roles: dict[tuple[int, int], tuple[str, str]] = {}  # (pid, tid) -> (kind, role), named once training runs
    tries = 0
    try:
        while True:
            try:
                st = run.wait(timeout_s=0.2)
                break
            except TimeoutError:
                cpu = ray_cpu_s()
                readings.append((time.time(), cpu))
                if threads:
                    data = [p for p, (k, _) in cpu.items() if k in ("workers", "keepers")]
                    per_thread.append(thread_cpu_s(data))
                    if tries < 5 and _rows_so_far(run) >= WARM[preset] and not _each_trains(roles, cpu):
                        tries += 1  # a dump may catch a stack half-read (--nonblocking): again, up to 5 times
                        for p in data:
                            for t, r in thread_roles(p).items():
                                if roles.get((p, t), ("", ""))[1] != "training":
                                    roles[(p, t)] = (cpu[p][0], r)
    finally:
        run.finish()
    if st["state"] != "SUCCEEDED":
        raise RuntimeError(f"job {run.job_id} ({preset}, {ckpt}) ended {st['state']}: {run.events[-3:]}")
    all_rows = run.rows()
    rows = all_rows[WARM[preset]:]
    wall = rows[-1]["end_time"] - rows[0]["end_time"]
    tokens = sum(r["tokens"] for r in rows[1:])
    blocks = [r["ckpt_block_s"] for r in rows]
    steps = [r["step_time_s"] for r in rows]
    ends = [r["end_time"] for r in all_rows]
    inside = [i for i, (t, _) in enumerate(readings) if rows[0]["end_time"] <= t <= rows[-2]["end_time"]]
    cpu: dict[str, float] = {}
    by_thread: dict[str, float] = {}
    if len(inside) >= 2:  # the first and last reading inside the steady steps, per step done between them
        (t0, c0), (t1, c1) = readings[inside[0]], readings[inside[-1]]
        done = step_position(ends, t1) - step_position(ends, t0)
        if done > 0:
            cpu = {k: v / done for k, v in cpu_between(c0, c1).items()}
            if per_thread:
                a, b = per_thread[inside[0]], per_thread[inside[-1]]
                for key, v in b.items():
                    if key in a:
                        kind, role = roles.get(key, (c1.get(key[0], ("ray", 0.0))[0], "other"))
                        name = f"{kind} {role}"
                        by_thread[name] = by_thread.get(name, 0.0) + (v - a[key]) / done
    return {"tps": tokens / wall, "block_med": statistics.median(blocks), "block_max": max(blocks),
            "block_mean": statistics.fmean(blocks), "step_med": statistics.median(steps), "cpu": cpu,
            "threads": by_thread}


def _each_trains(roles: dict[tuple[int, int], tuple[str, str]], cpu: dict[int, tuple[str, float]]) -> bool:
    """Whether a training thread was found in every worker."""
    workers = {p for p, (k, _) in cpu.items() if k == "workers"}
    return bool(workers) and workers <= {p for (p, _), (_, r) in roles.items() if r == "training"}


def _rows_so_far(run: Any) -> int:
    try:
        return len(run.rows())
    except OSError:  # metrics.jsonl not written yet
        return 0


def bench_preset(tmp: Path, preset: str, rounds: int, persist: int, tcp: bool, threads: bool = False) -> dict[str, Any]:
    arms: dict[str, dict[str, Any]] = {"none": {"in_memory_every": 0}, "snap": {"in_memory_every": 1}}
    if tcp:
        arms["snap-tcp"] = {"in_memory_every": 1, "snapshot_shared_memory": False}
    if persist:
        arms["snap+persist"] = {"in_memory_every": 1, "persist_every": persist}
    names = list(arms)
    res: dict[str, list[dict[str, Any]]] = {a: [] for a in names}
    for i in range(rounds):
        order = names if i % 2 == 0 else names[::-1]  # none/snap, then snap/none: pairs are adjacent
        for arm in order:
            r = _job(tmp / f"{preset}-{arm}-{i}", preset, arms[arm], threads)
            res[arm].append(r)
            print(f"  {preset} round {i} {arm:<13} {r['tps']:>9,.0f} tok/s  step {r['step_med'] * 1e3:6.1f} ms  "
                  f"block med {r['block_med'] * 1e3:6.2f} ms max {r['block_max'] * 1e3:6.2f} ms  "
                  f"CPU/step {sum(r['cpu'].values()) * 1e3:6.1f} ms", flush=True)
    out: dict[str, Any] = {"res": res}
    for arm in names[1:]:
        out[arm] = statistics.median(s["tps"] / n["tps"] for s, n in zip(res[arm], res["none"], strict=True))
    return out


def _cpu_median(runs: list[dict[str, Any]], key: str = "cpu") -> dict[str, float]:
    kinds = {k for r in runs for k in r[key]}
    return {k: statistics.median(r[key].get(k, 0.0) for r in runs) for k in kinds}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["debug", "small"], choices=sorted(STEPS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--persist", type=int, default=0, help="also a third arm persisting every N steps")
    ap.add_argument("--tcp", action="store_true", help="also an arm whose own-node copy goes over the socket "
                    "(checkpoint.snapshot_shared_memory: false), to weigh the shared-memory hand-over")
    ap.add_argument("--threads", action="store_true", help="also the workers' and keepers' CPU per step by thread "
                    "(training, copier, sender, keeper stream, ...)")
    args = ap.parse_args([] if argv is None else argv)
    from service.local_cluster import LocalCluster

    print(f"2 workers (1 CPU each), FSDP 2, one per node of a 2-node LocalCluster on {os.cpu_count()} cores; "
          f"jobs through the supervisor, alternating; {args.rounds} rounds per preset")
    results: dict[str, dict[str, Any]] = {}
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="snapshot_job_bench_") as d, \
            LocalCluster(head_cpus=1, object_store_mb=512) as cluster:  # fmt: skip
        cluster.add_node("b", num_cpus=1)
        cluster.connect()
        for preset in args.presets:
            results[preset] = bench_preset(Path(d), preset, args.rounds, args.persist, args.tcp, args.threads)
    print(f"\n({time.perf_counter() - t0:.0f}s; load average {os.getloadavg()[0]:.1f} at the end, "
          f"{load0:.1f} at the start: other work on this machine shares its {os.cpu_count()} cores)")
    print(f"{'preset':<8}{'arm':<14}{'tok/s (median)':>16}{'ratio vs none':>15}{'block/step med':>16}"
          f"{'mean':>10}{'max':>10}")
    for preset, out in results.items():
        for arm, runs in out["res"].items():
            tps = statistics.median(r["tps"] for r in runs)
            ratio = "" if arm == "none" else f"{out[arm]:.3f}"
            print(f"{preset:<8}{arm:<14}{tps:>16,.0f}{ratio:>15}"
                  f"{statistics.median(r['block_med'] for r in runs) * 1e3:>13.2f} ms"
                  f"{statistics.median(r['block_mean'] for r in runs) * 1e3:>7.2f} ms"
                  f"{max(r['block_max'] for r in runs) * 1e3:>7.1f} ms")
    print("CPU per steady step, all Ray processes (median over rounds), by kind:")
    for preset, out in results.items():
        med = {arm: _cpu_median(runs) for arm, runs in out["res"].items()}
        for arm, cpu in med.items():
            extra = "" if arm == "none" else "  (" + ", ".join(
                f"{k} {(v - med['none'].get(k, 0.0)) * 1e3:+.1f}" for k, v in sorted(cpu.items())) + " ms vs none)"
            print(f"  {preset:<7} {arm:<13} {sum(cpu.values()) * 1e3:7.1f} ms{extra}")
    if args.threads:
        print("CPU per steady step of the workers and keepers by thread (both ranks together; median over rounds):")
        for preset, out in results.items():
            med = {arm: _cpu_median(runs, "threads") for arm, runs in out["res"].items()}
            for name in sorted(set().union(*med.values()), key=lambda n: -med["snap"].get(n, 0.0)):
                none, snap = med["none"].get(name, 0.0), med["snap"].get(name, 0.0)
                if max(none, snap) >= 5e-4:
                    print(f"  {preset:<7} {name:<22} none {none * 1e3:7.1f} ms  snap {snap * 1e3:7.1f} ms  "
                          f"{(snap - none) * 1e3:+6.1f} ms")
    print("snapshot every step through the supervisor, tokens/s over none: "
          + ", ".join(f"{p} {o['snap']:.3f}" for p, o in results.items()) + " (goal >= 0.97)")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
