"""What the soak proves once its job is done, and the table it prints.

- the job SUCCEEDED, every step 1..N has one metrics row, and the losses equal the fault-free run's
  (one process, no Ray, the same engine) to 1e-4;
- no recovery lost more than one step (the `recovered` events' lost_steps, and for a supervisor
  restart the step its generation restored against the step the job had reached);
- every persistent checkpoint left in S3 re-hashes against its manifest;
- no actor, placement group or keeper memory of the job is left (asked of Ray by a driver process);
- each fault is found in the job's events with its cause (or, for the service's parts, the job was
  served again and nothing of it was lost).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.soak.schedule import JOB_KINDS, RECOVERY_KINDS, Fault


@dataclass
class Row:
    """One line of the table."""

    fault: Fault
    step: int | None = None  # the job's step when the fault acted
    detected: str = "-"
    recovery_s: float | None = None
    lost: int | None = None
    ok: bool = False
    note: str = ""


@dataclass
class Verdict:
    rows: list[Row]
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def reference_losses(spec: dict[str, Any], out: Path) -> list[float]:
    from service.spec import parse_spec
    from tests.runtime.jobs import engine_of
    from workers.launcher import run_local

    clean = {**spec, "chaos": [], "checkpoint": {"in_memory_every": 0, "persist_every": 0}}
    clean["training"] = {**spec["training"], "output_dir": str(out)}
    res = run_local(engine_of(parse_spec(clean)), 1, out, show_progress=False)
    return [json.loads(x)["loss"] for x in Path(res.metrics_path).read_text().splitlines()]


# The failure kind each in-job fault is expected to be detected as, and how many steps late it may be
# seen (a straggler needs a few steps of timings).
_EXPECTED = {
    "kill_worker": ("worker_died", 2), "sigkill_worker": ("worker_died", 2), "hang_worker": ("hang", 2),
    "raise_in_step": ("step_error", 2), "kill_node": ("node_died", 2), "slow_worker": ("straggler", 15),
}  # fmt: skip
# A node's loss may be seen first as what it causes: its ranks' peers fail in a collective before Ray or
# the node's agent has said the node is gone (the supervisor names the root cause it has by then).
_ALSO = {"kill_node": ("collective_error",)}


def _names_cause(kind: str, message: str) -> bool:
    """The event names the chaos fault as its cause ("chaos (kill_worker ..." or "(chaos: kill_worker)")."""
    return "chaos" in message and kind in message


def match_events(faults: list[Fault], acted: dict[int, tuple[int | None, str]], events: list[Any],
                 logs: list[str]) -> list[Row]:  # fmt: skip
    """A row per fault: the event that shows it, with its cause, and its recovery's time and lost steps.
    `acted`: index -> (step, what the driver did) for the driver's faults; `logs`: the job's log lines
    (each in-job fault writes `chaos: <kind> fires on rank R before step S+1` as it acts)."""
    evs = [(e.kind, e.message, e.data or {}, e.ts) for e in events]
    failures = [i for i, e in enumerate(evs) if e[0] == "failure_detected"]
    used: set[int] = set()
    rows = []
    restarts = [i for i, e in enumerate(evs) if e[0] == "supervisor_restarted"]
    for n, f in enumerate(faults):
        row = Row(f)
        if f.in_job and f.kind not in ("kill_keeper", "kill_supervisor"):
            row.step = f.step
            expect, late = _EXPECTED[f.kind]
            cand = [i for i in failures if i not in used
                    and f.step - 1 <= int(evs[i][2].get("step") or 0) <= f.step + late]
            also = _ALSO.get(f.kind, ())
            hit = next((i for i in cand if _names_cause(f.kind, evs[i][1])),
                       next((i for i in cand if evs[i][2].get("kind") == expect),
                            next((i for i in cand if evs[i][2].get("kind") in also), None)))
            if hit is not None:
                used.add(hit)
                row.detected = f"{evs[hit][2].get('kind')}: {_short(evs[hit][1])}"
                row.ok = _names_cause(f.kind, evs[hit][1]) or evs[hit][2].get("kind") in (expect, *also)
                if evs[hit][2].get("kind") in also:
                    row.note = f"seen first as what it caused ({evs[hit][2].get('kind')}), before the node's loss"
                _recovery(row, evs, hit)
            elif _fired(f, logs):
                # It acted while the supervisor was down (the workers train on meanwhile): the restarted
                # supervisor adopted the workers left alive and re-formed from its last commit.
                row.detected = "in the job's logs; acted while the supervisor restarted (adopted)"
                row.ok = any(e[0] == "adopted" for e in evs)
            elif (lost := _lost_at_adoption(f, evs)) is not None:
                # It took its process (or node) before its log line was sent, while the supervisor was down:
                # the restarted one found the rank gone and said so.
                row.step = f.step
                row.detected = f"adopted: {_short(lost)}"
                row.ok = True
        elif f.kind == "kill_keeper":
            row.step = f.step
            lost = next((i for i, e in enumerate(evs) if e[0] == "keeper_lost" and i not in used), None)
            row.ok = _fired(f, logs) and lost is not None
            if lost is not None:
                used.add(lost)
                row.detected = f"keeper_lost: {_short(evs[lost][1])}"
            elif _fired(f, logs) and _while_supervisor_down(f.step, evs):
                # No instance watched: the restarted one started a keeper on every node of the job anew.
                row.ok = True
                row.detected = "in the job's logs; acted while the supervisor restarted (keepers started anew)"
            else:
                row.detected = "in the job's logs only (no keeper_lost event)" if _fired(f, logs) else "not found"
        elif f.kind in ("kill_supervisor", "kill_supervisor@recovery"):
            row.step = f.step if f.in_job else acted.get(n, (None, ""))[0]
            hit = next((i for i in restarts if i not in used), None)
            if hit is not None:
                used.add(hit)
                row.detected, row.ok = "supervisor_restarted: adopted the running workers", True
                adopted = next((e for e in evs[hit:] if e[0] == "adopted"), None)
                gen = next((e for e in evs[hit:] if e[0] == "generation"), None)
                restored = (gen[2].get("restore") or {}).get("step") if gen is not None else None
                # The step the workers had reached when the restarted supervisor stopped them (they train
                # on while it is down): what a restore behind it loses. Older supervisors did not say it.
                reached = (adopted[2].get("step") if adopted is not None else None)
                reached = int(reached) if reached is not None else row.step
                if restored is not None and reached is not None:
                    row.lost = max(0, reached - int(restored))
                    row.note = f"the workers had reached step {reached}; re-formed from the snapshot of step {restored}"
                rec = next((e for e in evs[hit:] if e[0] in ("recovered", "recovery_interrupted", "failure_detected")),
                           None)
                if rec is not None and rec[0] == "recovered" and rec[2].get("kind") == "supervisor_restarted":
                    row.recovery_s = rec[2].get("total_s")
        else:
            row.step, row.note = acted.get(n, (None, "did not act"))
            row.ok = n in acted
            row.detected = _service_effect(f, evs, row.step)
            if row.note.startswith("skipped"):
                row.detected, row.note = "skipped", row.note.removeprefix("skipped: ")
            elif f.kind == "sigkill_worker@recovery":
                # A SIGKILL that is no chaos: the supervisor names Ray's cause ("... died: ...").
                hit = next((i for i in failures if i not in used and " died" in evs[i][1]
                            and "chaos" not in evs[i][1]), None)
                if hit is not None:
                    used.add(hit)
                    row.detected = f"{evs[hit][2].get('kind')}: {_short(evs[hit][1])}"
                    _recovery(row, evs, hit)
                else:
                    row.detected = "a worker outside the group (replaced by the pool)"
        rows.append(row)
    for i in failures:  # failures no fault of the schedule explains (e.g. a live node written off)
        if i not in used:
            row = Row(Fault("(not injected)", int(evs[i][2].get("step") or 0)), ok=True,
                      detected=f"{evs[i][2].get('kind')}: {_short(evs[i][1])}", note="a failure nothing injected")
            row.step = row.fault.step
            _recovery(row, evs, i)
            rows.append(row)
    return rows


def _short(message: str) -> str:
    """An event's message without the job-id prefix of worker names (the table is narrow)."""
    return re.sub(r"job-[0-9a-f]+/", "", message)[:90]


def _fired(f: Fault, logs: list[str]) -> bool:
    return any(f"chaos: {f.kind} fires on rank {f.rank} before step {f.step + 1}" in line for line in logs)


def _while_supervisor_down(step: int, evs: list[tuple[str, str, dict[str, Any], float]]) -> bool:
    """Whether `step` fell while no supervisor ran: within the steps an adoption took back from the workers
    (they trained on unwatched from `step - rows_recovered` to `step` of the `adopted` event)."""
    for kind, _msg, data, _ts in evs:
        if kind == "adopted" and "rows_recovered" in data:
            reached = int(data.get("step") or 0)
            if reached - int(data["rows_recovered"]) <= step <= reached:
                return True
    return False


def _lost_at_adoption(f: Fault, evs: list[tuple[str, str, dict[str, Any], float]]) -> str | None:
    """The `adopted` event that found f's rank dead, for a fault that ends its process (or node) and fired
    while the supervisor was down (at or before the step the workers had reached): its message."""
    if f.kind not in _EXPECTED or f.kind in ("raise_in_step", "slow_worker"):
        return None
    for kind, msg, data, _ts in evs:
        if kind == "adopted" and f.rank in (data.get("lost_ranks") or []) and int(data.get("step") or 0) >= f.step:
            return msg[msg.find("rank(s)"):] if "rank(s)" in msg else msg
    return None


def _recovery(row: Row, evs: list[tuple[str, str, dict[str, Any], float]], hit: int) -> None:
    """The `recovered` event that closes the recovery begun at evs[hit] (or the one after an interruption)."""
    for kind, _msg, data, _ts in evs[hit + 1:]:
        if kind == "recovered":
            row.recovery_s, row.lost = data.get("total_s"), data.get("lost_steps")
            return
        if kind in ("recovery_interrupted", "failure_detected", "supervisor_restarted"):
            row.note = "its recovery was cut short by the next fault (the next row's recovery completes it)"
            return


def _service_effect(f: Fault, evs: list[tuple[str, str, dict[str, Any], float]], step: int | None) -> str:
    if f.kind == "kill_s3":
        failed = [m for k, m, d, _ in evs if k == "checkpoint_failed"]
        return f"checkpoint_failed: {failed[0][:60]}" if failed else "no save failed (writes retried)"
    if f.kind == "sigkill_worker@recovery":
        return "the recovery re-planned around it"
    if f.kind == "kill_keeper":
        missing = [m for k, m, d, _ in evs if k in ("keepers_missing", "snapshot_failed")]
        return missing[0][:70] if missing else "not in the events"
    return {"restart_store": "the API answered 503 meanwhile; the supervisor's writes retried",
            "kill_api": "restarted API found the job by name"}.get(f.kind, "-")


def leaks(env: dict[str, str], address: str, job_id: str, settle_s: float = 30.0) -> dict[str, Any]:
    """The job's named actors, placement groups not removed, and keeper bytes, asked of Ray by a driver.
    The supervisor releases everything after the job's final status is stored, and exits a moment later:
    what is still there after `settle_s` is a leak."""
    code = f"""
import json, time, ray
ray.init(address={address!r}, log_to_driver=False)
from checkpointing.naming import NAMESPACE
deadline = time.monotonic() + {settle_s!r}
while True:
    named = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    actors = [n for n in named if n.startswith("job-{job_id}/")]
    groups = [str(i.get("name")) for i in ray.util.placement_group_table().values()
              if str(i.get("name", "")).startswith("job-{job_id}/") and i.get("state") != "REMOVED"]
    if not (actors or groups) or time.monotonic() > deadline:
        break
    time.sleep(0.5)
held = {{}}
for n in named:
    if n.startswith("keeper-"):
        try:
            rep = ray.get(ray.get_actor(n, namespace=NAMESPACE).memory_report.remote(), timeout=30)
            held[n] = rep["jobs"].get({job_id!r}, {{}}).get("bytes", 0)
        except Exception as e:
            held[n] = repr(e)[:100]
from workers.chaos import forget_claims  # the once-per-job chaos claims in Ray's KV: the soak's to drop
print(json.dumps({{"actors": actors, "groups": groups, "keeper_bytes": held,
                   "chaos_claims_dropped": forget_claims({job_id!r})}}))
"""
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                       cwd=str(Path(__file__).resolve().parents[2]))
    last = (r.stdout.strip().splitlines() or ["{}"])[-1]
    try:
        return json.loads(last)
    except json.JSONDecodeError:
        return {"error": r.stderr[-1500:]}


def checkpoints(uri: str, s3: dict[str, Any]) -> list[tuple[int, bool, str]]:
    """(step, valid, why) for every checkpoint under the job's root, each re-hashed."""
    from checkpointing.catalog import list_checkpoints, verify_files
    from checkpointing.config import S3Config
    from checkpointing.uri import open_store

    store = open_store(uri, S3Config(**s3))
    out = []
    for info in list_checkpoints(store):
        if info.manifest is None:
            out.append((info.step, False, f"no manifest ({info.reason})"))
            continue
        rep = verify_files(store, info)
        out.append((info.step, rep.ok, "; ".join(rep.problems)[:200]))
    return out


def judge(rows: list[Row], *, status: str, reason: str | None, steps: int, metrics: list[dict[str, Any]], ref: list[float],
          ckpts: list[tuple[int, bool, str]], leak: dict[str, Any], events: list[Any]) -> Verdict:  # fmt: skip
    v = Verdict(rows)
    p = v.problems
    if status != "SUCCEEDED":
        p.append(f"the job ended {status}: {reason}")
    got = [int(r["step"]) for r in metrics]
    if got != list(range(1, steps + 1)):
        p.append(f"metrics rows are not steps 1..{steps}: {len(got)} rows")
    else:
        worst = max(abs(float(r["loss"]) - x) for r, x in zip(metrics, ref, strict=True))
        if worst > 1e-4:
            p.append(f"losses differ from the fault-free run by up to {worst:.2e} (> 1e-4)")
    for e in events:
        if e.kind == "recovered" and int((e.data or {}).get("lost_steps") or 0) > 1:
            p.append(f"a recovery lost more than one step: {e.message}")
    for r in rows:
        if r.lost is not None and r.lost > 1:
            p.append(f"{r.fault.label} at step {r.fault.step}: {r.lost} steps lost")
        if not r.ok:
            p.append(f"{r.fault.label} at step {r.fault.step} not found in the events ({r.detected})")
    bad = [c for c in ckpts if not c[1]]
    if bad:
        p.append(f"checkpoints left invalid: {bad}")
    if not ckpts:
        p.append("no persistent checkpoint left")
    if leak.get("error") or leak.get("actors") or leak.get("groups") or any(
            v != 0 for v in leak.get("keeper_bytes", {}).values()):
        p.append(f"leaks: {leak}")
    kinds = {r.fault.kind for r in rows}
    missing = [k for k in (*JOB_KINDS, "kill_s3", "restart_store", "kill_api") if k not in kinds]
    if len(rows) >= 20 and missing:
        p.append(f"kinds never scheduled: {missing}")
    if not any(r.fault.kind in RECOVERY_KINDS and r.detected != "skipped" for r in rows):
        p.append("no fault acted inside a recovery")
    if not any(r.fault.during_save and r.fault.in_job and r.ok for r in rows):
        p.append("no fault acted during a persistent save")
    return v


def table(rows: list[Row]) -> str:
    head = f"{'#':>2}  {'fault':<34} {'step':>5}  {'detected as':<90} {'recovery':>8}  {'lost':>4}"
    lines = [head, "-" * len(head)]
    for i, r in enumerate(rows, 1):
        rec = f"{r.recovery_s:.1f}s" if r.recovery_s is not None else "-"
        lost = str(r.lost) if r.lost is not None else "-"
        mark = "" if r.ok else "  <-- not found"
        lines.append(f"{i:>2}  {r.fault.label:<34} {r.step if r.step is not None else '-':>5}  "
                     f"{r.detected[:90]:<90} {rec:>8}  {lost:>4}{mark}")
        if r.note:
            lines.append(f"{'':>4}{'':<34} {'':>5}  ({r.note[:100]})")
    return "\n".join(lines)
