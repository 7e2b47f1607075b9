"""Hot spares: how long training pauses when a warm spare replaces a killed rank, and when a replica
grows back after a shrink. A 3-worker FSDP job (0.5 CPU each) on a two-node LocalCluster (head: four
workers' room, node b: two).

- swap: resources.spares: 1; rank 1 is killed after step KILL_AFTER; the next generation takes the
  spare, dp stays 3. Pause = from the kill to the next completed step (the `recovered` event's total,
  split into detect / re-form / restore / replay).
- grow-back: no spare; the same kill shrinks the job 3 -> 2; the replacement replica starts, and the job
  grows back to 3 at a snapshot boundary (no failure). Pause = the gap between the last step of the dp-2
  generation and the first step at dp 3 (rank 0's step end times) minus the median step time.
- the swap's gap the same way, for a like-for-like figure.
- the swap four ways, ROUNDS each, interleaved: FSDP with the survivors' trainers kept
  (fault_tolerance.keep_trainer, the default) or built anew; three replicas (HSDP 3 x 1) with the spare
  healing from a live replica (checkpoint.heal_from_peer, the default) or reading the keepers.

Usage: python -m tests.benchmarks.spares_bench
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")

KILL_AFTER = 5
STEPS = 40
ROUNDS = 2  # of the swap variants
VARIANTS: dict[str, dict[str, Any]] = {
    "fsdp, trainers kept": {"keep_trainer": True},
    "fsdp, trainers built anew": {"keep_trainer": False},
    "hsdp, heal from a replica": {"parallelism": {"dp_replicate": 3, "dp_shard": 1}, "heal_from_peer": True},
    "hsdp, read the keepers": {"parallelism": {"dp_replicate": 3, "dp_shard": 1}, "heal_from_peer": False},
}
MODEL = {"dim": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 256, "max_seq_len": 64}


def _spec(out: Path, *, spares: int, chaos: list[dict[str, Any]], keep_trainer: bool = True,
          heal_from_peer: bool = True, parallelism: dict[str, Any] | None = None) -> Any:
    from service.spec import parse_spec

    return parse_spec({
        "name": "spares-bench", "model": MODEL,
        "training": {"steps": STEPS, "seq_len": 32, "global_batch_size": 12, "warmup_steps": 1,
                     "output_dir": str(out)},
        "parallelism": parallelism or {"dp_shard": 3},
        "resources": {"cpus_per_worker": 0.5, "dp": {"min": 1, "max": 3}, "spares": spares},
        "checkpoint": {"persist_every": 0, "in_memory_every": 1, "heal_from_peer": heal_from_peer},
        "fault_tolerance": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 30, "collective_timeout_s": 30,
                            "keep_trainer": keep_trainer},
        "chaos": chaos,
    })


def _run(spec: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from tests.runtime.jobs import JobRun

    run = JobRun(spec, job_id="sb-" + uuid.uuid4().hex[:6])
    try:
        st = run.wait(timeout_s=600)
        if st["state"] != "SUCCEEDED":
            raise RuntimeError(f"job ended {st['state']}: {st.get('reason')}; events {run.kinds()}")
        return run.events, run.rows()
    finally:
        run.finish()


def _gap(rows: list[dict[str, Any]], generation: int) -> float:
    """The pause at the start of `generation`: the gap between its first step's end and the end of the
    step before it, minus the median step time (the step that would have run anyway)."""
    first = next(i for i, r in enumerate(rows) if r["generation"] == generation)
    steps = [b["end_time"] - a["end_time"] for a, b in zip(rows, rows[1:], strict=False)
             if a["generation"] == b["generation"]]
    return rows[first]["end_time"] - rows[first - 1]["end_time"] - statistics.median(steps)


def _formed_lines(temp_dir: str, generation: int) -> list[str]:
    """The ranks' own words on forming `generation` (join, build, restore), from the workers' Ray logs."""
    import re

    out = []
    for f in Path(temp_dir, "session_latest", "logs").glob("worker-*.out"):
        for line in f.read_text(errors="replace").splitlines():
            if re.search(rf"generation {generation}: rank \d+ of", line) and ("formed in" in line or "joined" in line):
                out.append(line.split(" INFO ", 1)[-1])
    return sorted(out)


def main() -> None:
    from service.local_cluster import LocalCluster

    kill = {"kind": "kill_worker", "step": KILL_AFTER, "rank": 1}
    # Without a spare: rank 0 slows after the shrink, so the replacement replica starts before the end.
    slow = {"kind": "slow_worker", "step": KILL_AFTER + 1, "rank": 0, "seconds": 0.3, "generation": 1}
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(head_cpus=2) as cluster:
        cluster.add_node("b", num_cpus=1)
        cluster.connect()
        t0 = time.time()
        events, rows = _run(_spec(Path(tmp) / "swap", spares=1, chaos=[kill]))
        swap_wall = time.time() - t0
        formed = _formed_lines(cluster.temp_dir, 1)
        rec = next(e["data"] for e in events if e["kind"] == "recovered")
        swapped = [e for e in events if e["kind"] == "spare_swapped"]
        dps = sorted({r["dp"] for r in rows})
        swap_gap = _gap(rows, 1)

        # The swap four ways, interleaved: FSDP with the survivors' trainers kept (the default) or built
        # anew; three replicas (HSDP 3 x 1) with the spare healing from a live replica or reading the keepers.
        ab: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
        for i in range(ROUNDS):
            for j, (name, kw) in enumerate(VARIANTS.items()):
                ev, _ = _run(_spec(Path(tmp) / f"ab{i}-{j}", spares=1, chaos=[kill], **kw))
                ab[name].append(next(e["data"] for e in ev if e["kind"] == "recovered"))

        events2, rows2 = _run(_spec(Path(tmp) / "grow", spares=0, chaos=[kill, slow]))
        grown = [e["data"] for e in events2 if e["kind"] == "resized" and e["data"]["new_dp"] > e["data"]["old_dp"]]
        grow_gap = _gap(rows2, grown[0]["generation"]) if grown else None

    print(f"swap (spares: 1, kill rank 1 after step {KILL_AFTER}; {swap_wall:.0f}s wall): "
          f"{'spare_swapped' if swapped else 'NO SWAP'}, dp over the run {dps}")
    print(f"  kill -> next completed step {rec['total_s']:.2f}s: detect {rec['detect_s'] or 0:.2f}s, re-form "
          f"{rec['reform_s']:.2f}s, restore {rec['restore_s']:.2f}s, replay {rec['replay_s']:.2f}s; "
          f"lost {rec['lost_steps']} step(s)")
    print(f"  pause at the swap (step gap - median step): {swap_gap:.2f}s")
    for line in formed:
        print(f"  {line}")
    shrink = next(e["data"] for e in events2 if e["kind"] == "recovered")
    print(f"no spare, same kill (shrink 3 -> 2): kill -> next completed step {shrink['total_s']:.2f}s: detect "
          f"{shrink['detect_s'] or 0:.2f}s, re-form {shrink['reform_s']:.2f}s, restore {shrink['restore_s']:.2f}s, "
          f"replay {shrink['replay_s']:.2f}s")
    if grow_gap is None:
        print("grow-back: the job did not grow back before its end (no `resized` to a larger dp)")
    else:
        print(f"grow-back (no spare: shrink 3 -> 2, then 2 -> 3 at generation {grown[0]['generation']}): "
              f"pause {grow_gap:.2f}s")
    print(f"swap four ways ({ROUNDS} round(s) each, interleaved; medians):")
    med: dict[str, dict[str, float]] = {}
    for name, recs in ab.items():
        med[name] = {k: statistics.median(float(r[k] or 0) for r in recs)
                     for k in ("total_s", "detect_s", "reform_s", "restore_s", "replay_s")}
        m = med[name]
        print(f"  {name:26}: kill -> next step {m['total_s']:.2f}s: detect {m['detect_s']:.2f}s, re-form "
              f"{m['reform_s']:.2f}s, restore {m['restore_s']:.2f}s, replay {m['replay_s']:.2f}s; in place "
              f"{[r.get('in_place_ranks') for r in recs]}, sources {[r.get('source') for r in recs]}")
    names = list(VARIANTS)
    print(f"  kept / anew (kill -> next step): {med[names[0]]['total_s'] / med[names[1]]['total_s']:.2f}; "
          f"re-form + restore {(med[names[0]]['reform_s'] + med[names[0]]['restore_s']):.2f}s vs "
          f"{(med[names[1]]['reform_s'] + med[names[1]]['restore_s']):.2f}s")
    print(f"  heal from a live replica / read the keepers (restore): "
          f"{med[names[2]]['restore_s'] / max(med[names[3]]['restore_s'], 1e-9):.2f}")
    print(f"spares: swap pause {rec['total_s']:.2f}s (kill -> next step), grow-back pause "
          + (f"{grow_gap:.2f}s" if grow_gap is not None else "n/a"))


if __name__ == "__main__":
    main()
