"""`unbroken run job.yaml [--address ADDR]`: run one job under its supervisor and follow it.

Without --address it starts a private Ray cluster on this machine (service.local_cluster, on
loopback; `--node NAME=CPUS` adds simulated nodes), runs the job's supervisor there, streams the
job's events and a progress bar, and stops the cluster at the end. With --address it uses a running
cluster. Exit status: 0 when the job SUCCEEDED, 1 otherwise; Ctrl-C cancels the job.
Nothing heavy is imported until the command runs.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import typer


def _parse_nodes(nodes: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in nodes:
        name, _, cpus = item.partition("=")
        try:
            out[name.strip()] = float(cpus)
        except ValueError:
            raise typer.BadParameter(f"--node {item!r}: write NAME=CPUS, e.g. --node b=2") from None
        if not name.strip() or name.strip() == "head":
            raise typer.BadParameter(f"--node {item!r}: name the node (not 'head'), e.g. --node b=2")
    return out


class _WithoutRayDeathGuesses:
    """stdout without Ray's own note on a dead worker ("(raylet) A worker died or was killed ... OOM
    killer ..."): the job's events name the actual cause (a chaos kill, a node loss, the process's
    error) a moment later, and Ray's text guesses. Everything else passes through unchanged."""

    MARK = "A worker died or was killed while executing a task"

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._dropped = False

    def write(self, text: str) -> int:
        if self.MARK in text:
            self._dropped = True
            return len(text)
        if self._dropped and text == "\n":  # print()'s line end of the dropped note
            self._dropped = False
            return len(text)
        self._dropped = False
        return int(self._stream.write(text))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _fmt_event(ev: dict[str, Any], t0: float) -> str:
    return f"[{ev['ts'] - t0:7.2f}s] {ev['kind']:<20} {ev['message']}"


def run_job(
    job_file: Path,
    *,
    address: str | None,
    num_cpus: float | None,
    nodes: dict[str, float],
    output: str | None,
    job_id: str | None,
    progress: bool,
) -> int:
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback only; before ray is imported
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from service.spec import SpecError, load_spec_file

    try:
        spec = load_spec_file(job_file)
    except SpecError as e:
        typer.echo(f"error: {job_file}: {e}", err=True)
        return 2
    from service.job_paths import folder_owner, resolve_job_paths

    named = output or spec.training.output_dir
    # A folder named again is that run's own: the job goes on with its id (and its checkpoints).
    jid = job_id or (named and folder_owner(Path(named).expanduser())) or f"run-{uuid.uuid4().hex[:8]}"
    if named:
        spec.training.output_dir = str(Path(named).expanduser().resolve())
    spec = resolve_job_paths(spec, jid, Path("runs"))
    out_dir = Path(str(spec.training.output_dir))
    from parallel.config import resolve_local_paths

    resolve_local_paths(spec.model, spec.data)
    import ray

    from service.local_cluster import LocalCluster
    from service.statuses import FAILED, SUCCEEDED
    from service.supervisor import launch_supervisor
    from workers.progress import StepProgress

    cluster: LocalCluster | None = None
    stdout = sys.stdout
    sys.stdout = _WithoutRayDeathGuesses(stdout)  # type: ignore[assignment]
    if address:
        ray.init(address=address, namespace="unbroken", log_to_driver=False)
    else:
        cluster = LocalCluster(head_cpus=num_cpus if num_cpus is not None else float(os.cpu_count() or 2))
        typer.echo(f"an embedded Ray cluster; its logs in {cluster.temp_dir} (removed if the job succeeds)",
                   err=True)
        cluster.start()
        for name, cpus in nodes.items():
            cluster.add_node(name, num_cpus=cpus)
        cluster.connect()
    state = FAILED
    try:
        handle = launch_supervisor(jid, spec, store_url=None)
        typer.echo(f"job {jid}: output in {out_dir}", err=True)
        t0 = time.time()
        seen = 0
        cancelled = False
        with StepProgress(spec.training.steps, enabled=progress) as bar:
            while True:
                try:
                    evs = ray.get(handle.events.remote(after=seen), timeout=60)
                    for ev in evs:
                        typer.echo(_fmt_event(ev, t0), err=True)
                    seen += len(evs)
                    st = ray.get(handle.status.remote(), timeout=60)
                    if st.get("last_metrics"):
                        bar.update(st["last_metrics"])
                    if st["done"]:
                        for ev in ray.get(handle.events.remote(after=seen), timeout=60):
                            typer.echo(_fmt_event(ev, t0), err=True)
                        state = st["state"]
                        if st.get("reason"):
                            typer.echo(f"reason: {st['reason']}", err=True)
                        break
                    time.sleep(0.5)
                except KeyboardInterrupt:
                    if cancelled:
                        raise
                    cancelled = True
                    typer.echo("cancelling the job (Ctrl-C again to leave it)...", err=True)
                    handle.cancel.remote()
        handle.shutdown.remote()
        typer.echo(f"job {jid}: {state}; metrics in {out_dir / 'metrics.jsonl'}", err=True)
    finally:
        sys.stdout = stdout
        if cluster is not None:  # Ray's logs of a job that did not succeed are kept, and said where
            kept = state != SUCCEEDED
            cluster.shutdown(keep_logs=kept)
            if kept:
                typer.echo(f"Ray's logs (the workers' own output among them): {cluster.temp_dir}/session_latest/logs",
                           err=True)
        elif ray.is_initialized():
            ray.shutdown()
    return 0 if state == SUCCEEDED else 1


def run(
    job_file: Path = typer.Argument(..., help="the job spec (YAML or JSON)"),
    address: str = typer.Option(None, help="a running Ray cluster (HOST:PORT); default: start a private one here"),
    num_cpus: float = typer.Option(None, help="CPUs of the embedded cluster's head node (default: all)"),
    node: list[str] = typer.Option([], help="with the embedded cluster: add a simulated node NAME=CPUS (repeat)"),
    output: str = typer.Option(None, help="output folder (default: training.output_dir of the job, else a fresh "
                                          "runs/<run-id>); naming a run's folder again goes on with that run"),
    job_id: str = typer.Option(None, help="the job's id (default: a fresh one)"),
    progress: bool = typer.Option(True, help="show a progress bar"),
) -> None:
    """Run a job elastically under its supervisor, streaming its events and progress."""
    if address and node:
        raise typer.BadParameter("--node adds nodes to the embedded cluster; it cannot be used with --address")
    code = run_job(job_file, address=address, num_cpus=num_cpus, nodes=_parse_nodes(node), output=output,
                   job_id=job_id, progress=progress)
    sys.stdout.flush()
    raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the CLI."""
    app.command("run")(run)
