"""The demo (`make demo`): the service trains a Llama on 4 workers, loses one mid-run, and carries on.

Everything runs on this machine, private to the demo, and is stopped when it ends (also on
Ctrl-C or an error):

1. a Ray cluster of two nodes started as a user starts one (`ray start --head`, `ray start --address`);
2. a local S3 server (SeaweedFS) with a bucket for the persistent checkpoints;
3. the Unbroken control plane as a user starts it: `unbroken serve --address <the cluster>` (REST API,
   web console, scheduler, SQLite job store), on a free port;
4. a job submitted through the SDK (examples/demo_job.yaml): a Llama-style model learns the
   Python standard library's own source, byte-level, on 4 workers (FSDP), with an in-memory
   snapshot every step, an S3 checkpoint every 10 steps, and one worker killed at step 15;
5. a live view fed by the SDK (progress, loss, tokens/s, dp, recoveries, events as they come):
   the failure, the resize 4 -> 3, the restore from memory, and the growth back when a
   replacement is ready;
6. a summary: losses, the recovery time split, checkpoints (SDK and S3), where metrics.jsonl is.

    python -m examples.demo [--steps N] [--kill-step S] [--run-dir runs/demo]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

EXAMPLES = Path(__file__).resolve().parent
JOB_FILE = EXAMPLES / "demo_job.yaml"
MARKER = ".unbroken-demo"  # a run folder holding this file is the demo's own, safe to clear
BUCKET = "unbroken-demo"
WORKERS = 4
HEAD_CPUS = 2  # logical CPUs per node: 2 workers on each (the keepers and the supervisor take none)
NODE_B_CPUS = 2


# ============================================================================ processes
def _proc_stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, start time in clock ticks, name) of a live process, from /proc."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # a zombie has exited; only its parent's wait() is missing
        return None
    return int(fields[1]), int(fields[19]), name


def descendants(root: int) -> dict[tuple[int, int], str]:
    """Every live process below `root`, keyed by (pid, start time) so a reused pid is not mistaken."""
    children: dict[int, list[tuple[int, int, str]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _proc_stat(int(entry))
            if st is not None:
                children.setdefault(st[0], []).append((int(entry), st[1], st[2]))
    found: dict[tuple[int, int], str] = {}
    todo = [root]
    while todo:
        for pid, start, name in children.get(todo.pop(), []):
            if (pid, start) not in found:
                found[(pid, start)] = name
                todo.append(pid)
    return found


def still_alive(procs: dict[tuple[int, int], str]) -> dict[tuple[int, int], str]:
    out = {}
    for (pid, start), name in procs.items():
        st = _proc_stat(pid)
        if st is not None and st[1] == start:
            out[(pid, start)] = name
    return out


# ============================================================================ the job
def job_spec(run_dir: Path, s3: Any, steps: int | None, kill_step: int | None) -> dict[str, Any]:
    """examples/demo_job.yaml with this machine's data path, output folder and S3 server filled in."""
    data = yaml.safe_load(JOB_FILE.read_text(encoding="utf-8"))
    data["data"]["path"] = sysconfig.get_paths()["stdlib"]
    data["checkpoint"]["uri"] = f"s3://{BUCKET}/demo"
    data["checkpoint"]["s3"] = {
        "endpoint_url": s3.endpoint_url, "region": "us-east-1",
        "access_key_id": s3.access_key, "secret_access_key": s3.secret_key,
    }
    if steps is not None:
        data["training"]["steps"] = steps
        data["training"]["warmup_steps"] = min(data["training"]["warmup_steps"], steps)
    if kill_step is not None:
        data["chaos"][0]["step"] = kill_step
    return data


# ============================================================================ the live view
EVENT_STYLE = {
    "submitted": ("SUBMITTED", "dim"),
    "admitted": ("ADMITTED", "dim"),
    "supervisor_started": ("SUPERVISOR", "dim"),
    "started": ("STARTED", "dim"),
    "replica_ready": ("WORKER", "dim"),
    "state": ("STATE", "dim"),
    "released": ("RELEASED", "dim"),
    "failure_detected": ("FAILURE", "bold red"),
    "resized": ("RESIZE", "bold yellow"),
    "growing": ("GROW", "yellow"),
    "recovered": ("RECOVERED", "bold green"),
    "resumed": ("RESUMED", "green"),
    "recovery_interrupted": ("INTERRUPTED", "bold yellow"),
    "warning": ("WARNING", "bold yellow"),
    "checked": ("CHECKED", "dim"),
    "checkpointed": ("CHECKPOINT", "cyan"),
    "checkpoint_failed": ("CKPT FAILED", "bold red"),
    "generation": ("GENERATION", "bold"),
    "finished": ("FINISHED", "bold green"),
    "failed": ("FAILED", "bold red"),
    "cancelled": ("CANCELLED", "bold red"),
    "straggler": ("STRAGGLER", "yellow"),
    "waiting_for_capacity": ("WAITING", "yellow"),
}
QUIET_KINDS = {"status"}  # the store's copy of each state change; the supervisor's `state` says the same


def print_event(console: Console, ev: Any, t0: float) -> None:
    if ev.kind in QUIET_KINDS:
        return
    label, style = EVENT_STYLE.get(ev.kind, (ev.kind, "dim"))
    console.print(f"[dim]{ev.ts - t0:+7.1f}s[/dim] [{style}]{label:<11}[/{style}] {ev.message}",
                  highlight=False, soft_wrap=True)


class LiveView:
    """A rich progress bar on a terminal (plain lines elsewhere), fed by the SDK's job polls."""

    def __init__(self, console: Console, total: int) -> None:
        self.console = console
        self.total = total
        self.bar: Any = None
        self._task: Any = None
        self._last_plain = 0

    def __enter__(self) -> LiveView:
        if self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("[bold]{task.fields[status]:<10}"), BarColumn(bar_width=24), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                TextColumn("dp {task.fields[dp]}"), TextColumn("recoveries {task.fields[rec]}"),
                TimeElapsedColumn(), console=self.console,
            )
            self.bar.start()
            self._task = self.bar.add_task("job", total=self.total, status="PENDING", loss="-", tps="-", dp="-",
                                           rec=0)
        return self

    @property
    def out(self) -> Console:
        return self.bar.console if self.bar is not None else self.console

    def update(self, p: Any) -> None:
        """`p`: the SDK's JobProgress."""
        step = p.step or 0
        loss = f"{p.loss:.3f}" if p.loss is not None else "-"
        tps = f"{p.tokens_per_s:,.0f}" if p.tokens_per_s is not None else "-"
        dp = p.dp if p.dp is not None else "-"
        if self.bar is not None:
            self.bar.update(self._task, completed=step, status=p.status, loss=loss, tps=tps, dp=dp,
                            rec=p.recoveries)
        elif step >= self._last_plain + 5 or (step == self.total and step != self._last_plain):
            self._last_plain = step
            self.console.print(f"          [bold]progress[/bold]    step {step}/{self.total}  loss {loss}  "
                               f"{tps} tok/s  dp {dp}  recoveries {p.recoveries}  ({p.status})", highlight=False)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def follow_job(client: Any, job_id: str, total: int, console: Console, t0: float, timeout_s: float) -> Any:
    """Show the job's progress and events until it ends; returns the final Job."""
    from unbroken import JobProgress

    last, released = 0, False

    def drain(out: Console) -> None:
        nonlocal last, released
        while page := list(client.events(job_id, follow=False, after=last)):
            for ev in page:
                last = max(last, ev.id)
                released = released or ev.kind == "released"
                print_event(out, ev, t0)

    # Polled here, not through client.wait: its callback fires when the progress changes, and while the
    # workers start (tens of seconds) it does not, so the start-up's events would show only at the first step.
    deadline = time.monotonic() + timeout_s
    with LiveView(console, total) as view:
        while True:
            job = client.get(job_id)
            drain(view.out)
            view.update(JobProgress.of(job))
            if job.terminal:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is still {job.status} after {timeout_s:g} s")
            time.sleep(0.5)
    # The supervisor's last words (release of workers and keeper memory) land just after the end,
    # unless the live view already showed them.
    deadline = time.monotonic() + 10
    while not released and time.monotonic() < deadline:
        time.sleep(0.3)
        drain(console)
    return job


# ============================================================================ the summary
def dp_timeline(rows: list[dict[str, Any]]) -> str:
    """'4 (steps 1-15) -> 3 (16-27) -> 4 (28-50)' from the metrics rows."""
    spans: list[list[int]] = []
    for r in rows:
        if spans and spans[-1][0] == r["dp"]:
            spans[-1][2] = r["step"]
        else:
            spans.append([r["dp"], r["step"], r["step"]])
    return " -> ".join(f"{dp} (steps {a}-{b})" for dp, a, b in spans)


def summarize(console: Console, client: Any, job: Any, s3: Any, run_dir: Path) -> None:
    from examples.local_demo import text_chart

    rows = client.metrics(job.id)
    events = list(client.events(job.id, follow=False))
    losses = [float(r["loss"]) for r in rows]
    console.print(f"job {job.id} [bold]{job.status}[/bold]"
                  + (f": {job.reason}" if job.reason and job.status != "SUCCEEDED" else "")
                  + f"; {len(rows)} of {job.progress.total_steps or len(rows)} steps in "
                  f"{(job.finished_at or time.time()) - (job.started_at or job.created_at):.1f}s, "
                  f"{job.progress.recoveries} recovery(ies)", highlight=False)
    if rows:
        console.print(f"loss {losses[0]:.3f} at step {rows[0]['step']} -> {losses[-1]:.3f} at step "
                      f"{rows[-1]['step']} (guessing bytes uniformly is ln 256 = 5.545)", highlight=False)
        tps = [float(r["tokens_per_s"]) for r in rows if r.get("tokens_per_s")]
        if tps:
            console.print(f"throughput {sum(tps) / len(tps):,.0f} tokens/s (mean over steps, all workers)",
                          highlight=False)
        console.print(f"data-parallel degree: {dp_timeline(rows)}", highlight=False)
        console.print("\nloss per step (mean per bucket; the failure does not show: same batches, same state):")
        console.print(text_chart(losses, height=8, width=60), highlight=False, markup=False)

    console.print()
    for ev in events:
        if ev.kind == "failure_detected":
            console.print(f"[bold red]failure[/bold red]   {ev.message} ({(ev.data or {}).get('kind')})",
                          highlight=False)
        if ev.kind == "recovered":
            d = ev.data or {}
            s = {k: "n/a" if d.get(k) is None else f"{d[k]:.2f}s"
                 for k in ("total_s", "detect_s", "reform_s", "restore_s", "replay_s")}
            console.print(
                f"[bold green]recovery[/bold green]  {s['total_s']} from the fault to the next completed step: "
                f"detect {s['detect_s']}, re-form {s['reform_s']}, restore {s['restore_s']}, replay {s['replay_s']}; "
                f"restored step {d.get('restored_step')} from {'/'.join(d.get('source') or [])}, "
                f"{d.get('lost_steps', 0)} step(s) lost", highlight=False)
        if ev.kind == "resized":
            console.print(f"[bold yellow]resized[/bold yellow]   {ev.message} ({(ev.data or {}).get('cause')})",
                          highlight=False)

    g = client.goodput(job.id)
    console.print(f"[bold]goodput[/bold]   {g.summary} (client.goodput)", highlight=False)

    ckpts = client.checkpoints(job.id)
    console.print(f"\ncheckpoints recorded by the service (client.checkpoints): {len(ckpts)}")
    for c in ckpts:
        console.print(f"  step {c.step:>4}  {c.tier:<10}  {c.uri}", highlight=False)
    listing: dict[str, list[int]] = {}
    paginator = s3.client().get_paginator("list_objects_v2")
    prefix = f"demo/{job.id}/"  # each job writes under <checkpoint.uri>/<job-id>
    for page in paginator.paginate(Bucket=BUCKET, Prefix=prefix):
        for obj in page.get("Contents", []):
            top = obj["Key"][len(prefix):].split("/")[0]
            listing.setdefault(top, []).append(int(obj["Size"]))
    console.print(f"in S3 at s3://{BUCKET}/{prefix} (keep_last=3; older ones were deleted by retention):")
    for name, sizes in sorted(listing.items()):
        console.print(f"  {name:<24} {len(sizes):>3} objects, {sum(sizes) / 1e6:6.2f} MB", highlight=False)

    started = next((e for e in events if e.kind == "started" and e.data), None)
    folder = Path(started.data["output_dir"]) if started is not None else run_dir
    metrics_path = folder / "metrics.jsonl"
    n = len(metrics_path.read_text().splitlines()) if metrics_path.exists() else 0
    console.print(f"\nmetrics.jsonl: {metrics_path} ({n} lines, one a step)", highlight=False)


# ============================================================================ main
def section(console: Console, n: int, title: str) -> None:
    console.print()
    console.rule(f"[bold]{n}. {title}", align="left")


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def prepare_run_dir(path: Path) -> None:
    """Start from an empty folder; refuse to clear one the demo did not make."""
    if path.exists() and any(path.iterdir()):
        if not (path / MARKER).exists():
            raise SystemExit(f"error: --run-dir {path} is not empty and not a demo folder; pick another folder")
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / MARKER).write_text("made by `python -m examples.demo`; cleared by its next run\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=int(os.environ.get("UNBROKEN_DEMO_STEPS", 0)) or None,
                        help="training steps (default: the job file's, 50; env UNBROKEN_DEMO_STEPS)")
    parser.add_argument("--kill-step", type=int, default=None, help="the step at which rank 1 dies (default 15)")
    parser.add_argument("--run-dir", default="runs/demo", help="the demo's folder (job store, S3 data, metrics)")
    parser.add_argument("--timeout", type=float, default=900.0, help="give up on the job after this many seconds")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 2:
        parser.error("--steps must be at least 2")
    kill = args.kill_step if args.kill_step is not None else 15
    steps = args.steps if args.steps is not None else 50
    if not 0 < kill < steps:
        parser.error(f"--kill-step {kill} must fall inside the run (1..{steps - 1})")

    console = Console(highlight=False, soft_wrap=True)  # log files get whole lines
    run_dir = Path(args.run_dir).expanduser().resolve()
    prepare_run_dir(run_dir)
    home = run_dir / "home"  # the demo's own token file: the user's ~/.unbroken is left alone
    t_start = time.monotonic()
    old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
    ray_tmp = tempfile.mkdtemp(prefix="ubdemo-", dir="/tmp")  # short: Ray's socket paths stay < 108 chars
    stack = contextlib.ExitStack()
    started: dict[tuple[int, int], str] = {}
    ok = False
    console.rule("[bold]Unbroken: an elastic, fault-tolerant training service (demo)")
    console.print(f"run folder {run_dir}; everything started here is stopped at the end")
    try:
        with stack:
            ok = _run(args, steps, kill, console, run_dir, home, ray_tmp, stack, started) == 0
            section(console, 7, "Shutting down what the demo started")
            started.update(descendants(os.getpid()))
        left = _wait_gone(started, 20.0)
        if left:
            console.print(f"[bold red]left behind[/bold red] {len(left)} process(es): "
                          + ", ".join(f"{pid} ({name})" for (pid, _), name in left.items()) + "; killing them")
            for pid, _ in left:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        else:
            console.print(f"all {len(started)} processes the demo started have exited")
    except KeyboardInterrupt:
        console.print("\n[bold red]interrupted[/bold red]: everything the demo started is stopped")
        _reap(started)
        return 130
    except Exception:
        console.print_exception()
        console.print("[bold red]the demo failed[/bold red]; everything it started is stopped. "
                      f"Ray's logs: {ray_tmp}/session_latest/logs")
        _reap(started)
        return 1
    finally:
        signal.signal(signal.SIGTERM, old_term)
    from service.local_cluster import discard_ray_temp

    discard_ray_temp(ray_tmp, keep_logs=not ok)
    if not ok:
        console.print(f"Ray's logs are kept in {ray_tmp}/session_latest/logs")
    console.print(f"\ndemo {'done' if ok else 'FAILED'} in {time.monotonic() - t_start:.0f}s")
    return 0 if ok else 1


def _wait_gone(procs: dict[tuple[int, int], str], timeout_s: float) -> dict[tuple[int, int], str]:
    deadline = time.monotonic() + timeout_s
    left = still_alive(procs)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = still_alive(left)
    return left


def _reap(started: dict[tuple[int, int], str]) -> None:
    """After an error or Ctrl-C: the orderly stops already ran; SIGKILL any process of ours still there."""
    started.update(descendants(os.getpid()))
    for pid, _ in _wait_gone(started, 10.0):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _step(console: Console, what: str, fn: Callable[[], Any]) -> Any:
    t = time.monotonic()
    out = fn()
    console.print(f"  {what} [dim]({time.monotonic() - t:.1f}s)[/dim]", highlight=False)
    return out


def _run(args: argparse.Namespace, steps: int, kill: int, console: Console, run_dir: Path, home: Path,
         ray_tmp: str, stack: contextlib.ExitStack, started: dict[tuple[int, int], str]) -> int:
    # ---- 1. Ray
    section(console, 1, "A Ray cluster of two nodes, started as a user starts one (ray start)")
    from examples.user_cluster import RayStartCluster, Serve

    cluster = RayStartCluster(head={"num-cpus": str(HEAD_CPUS)}, temp=ray_tmp)

    def stop_cluster() -> None:
        started.update(descendants(os.getpid()))  # Ray's workers too, to check they are gone after
        t = time.monotonic()
        cluster.stop()
        console.print(f"  Ray cluster stopped (both nodes) [dim]({time.monotonic() - t:.1f}s)[/dim]")

    stack.callback(stop_cluster)
    console.print(f"  ray start --head --port {cluster.port} --num-cpus {HEAD_CPUS}", highlight=False, markup=False)
    console.print(f"  ray start --address {cluster.address} --num-cpus {NODE_B_CPUS}", highlight=False,
                  markup=False)
    cluster.add_node("b", num_cpus=NODE_B_CPUS)
    _step(console, "both nodes up", lambda: cluster.wait_nodes(2))
    console.print(f"  address {cluster.address}; {HEAD_CPUS}+{NODE_B_CPUS} logical CPUs (1 a worker)",
                  highlight=False)

    # ---- 2. S3
    section(console, 2, "Object storage: a local S3 server (SeaweedFS)")
    from checkpointing.local_s3 import LocalS3Server

    s3 = LocalS3Server(run_dir / "s3")

    def stop_s3() -> None:
        pid = s3.proc.pid if s3.proc is not None else None
        t = time.monotonic()
        s3.stop()
        console.print(f"  S3 server stopped (pid {pid}) [dim]({time.monotonic() - t:.1f}s)[/dim]")

    stack.callback(stop_s3)
    _step(console, "SeaweedFS ready", s3.start)
    assert s3.proc is not None
    s3.create_bucket(BUCKET)
    console.print(f"  endpoint {s3.endpoint_url} (pid {s3.proc.pid}); bucket {BUCKET}", highlight=False)

    # ---- 3. the control plane
    section(console, 3, "The Unbroken control plane: unbroken serve (REST API + scheduler + job store)")
    serve = Serve(home, address=cluster.address, env=cluster.env)

    def stop_serve() -> None:
        t = time.monotonic()
        serve.stop()
        console.print(f"  unbroken serve stopped ({serve.url}) [dim]({time.monotonic() - t:.1f}s)[/dim]")

    stack.callback(stop_serve)
    console.print(f"  UNBROKEN_HOME={home} unbroken serve --address {cluster.address} --port {serve.port}",
                  highlight=False, markup=False)
    _step(console, "API server up", serve.wait_ready)
    os.environ["UNBROKEN_HOME"] = str(home)  # the SDK and the CLI read the token file serve wrote there
    token = json.loads((home / "token").read_text())["token"]
    console.print(f"  {serve.url} (OpenAPI docs at {serve.url}/docs); job store {home / 'unbroken.db'}",
                  highlight=False)
    console.print(f"  console: {serve.url}/ui  (sign in with the admin token: {token})", highlight=False,
                  markup=False)
    console.print("  from another terminal while it runs:", highlight=False)
    console.print(f"    UNBROKEN_HOME={home} unbroken list", highlight=False, markup=False)

    # ---- 4. submit through the SDK
    section(console, 4, "Submitting the job through the SDK")
    from unbroken import Client, JobSpec

    spec = JobSpec.model_validate(job_spec(run_dir, s3, steps, kill))
    client = Client()  # the token file that `unbroken serve` wrote
    stack.callback(client.close)
    m, t = spec.model, spec.training
    console.print(f"  model: Llama-style '{m.preset}' ({m.dim} dim, {m.n_layers} layers, {m.n_heads} heads, "
                  f"{m.kv_heads} kv heads), byte-level", highlight=False)
    console.print(f"  data: the Python standard library's source, {spec.data.path}", highlight=False)
    console.print(f"  training: {t.steps} steps of {t.global_batch_size}x{t.seq_len} tokens; "
                  f"dp {spec.resources.dp.min}..{spec.resources.dp.max} workers (FSDP), "
                  f"{spec.resources.cpus_per_worker:g} CPU each", highlight=False)
    ck = spec.checkpoint
    console.print(f"  checkpoints: in memory (keepers) every {ck.in_memory_every} step, "
                  f"{ck.uri} every {ck.persist_every} steps", highlight=False)
    console.print(f"  chaos: {', '.join(f'{c.kind} at step {c.step} on rank {c.rank}' for c in spec.chaos)}",
                  highlight=False)
    t_submit = time.time()
    job = client.submit(spec)
    console.print(f"  submitted: job {job.id} ({job.status})", highlight=False)

    # ---- 5. watch it
    section(console, 5, "Training (live, from the SDK: client.get + client.events)")
    console.print(f"[dim]At step {kill} a worker exits on purpose; Ray reports it with a '(raylet) A worker died' "
                  "line.[/dim]")
    job = follow_job(client, job.id, t.steps, console, t_submit, args.timeout)

    # ---- 6. summary
    section(console, 6, "Summary")
    summarize(console, client, job, s3, run_dir)
    console.print(f"console: {serve.url}/ui/jobs/{job.id} (it stops with the demo)", highlight=False)
    return 0 if job.status == "SUCCEEDED" else 1


if __name__ == "__main__":
    sys.exit(main())
