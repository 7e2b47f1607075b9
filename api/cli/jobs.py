"""`unbroken` job commands against the API: submit, list, status, events, logs, cancel, delete.

They talk to the server through the SDK (api.client) and read its URL and token from
$UNBROKEN_URL/$UNBROKEN_TOKEN or the token file `unbroken serve` writes. The SDK, httpx and
rich are imported inside the commands so `unbroken --help` stays fast.
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from api.client import Client, JobProgress

URL = typer.Option(None, "--url", envvar="UNBROKEN_URL", help="API URL (default: from ~/.unbroken/token)")
TOKEN = typer.Option(None, "--token", envvar="UNBROKEN_TOKEN", help="bearer token (default: from the token file)")


def _client(url: str | None, token: str | None) -> Client:
    from api.client import Client

    return Client(url, token)


def _fail(e: Exception) -> typer.Exit:
    from api.errors import ValidationFailed

    if isinstance(e, ValidationFailed) and e.fields:
        typer.secho("error: refused; fix these fields:", fg=typer.colors.RED, err=True)
        for field, msg in e.fields.items():
            typer.secho(f"  {field}: {msg}", fg=typer.colors.RED, err=True)
    else:
        typer.secho(f"error: {getattr(e, 'message', e)}", fg=typer.colors.RED, err=True)
    return typer.Exit(2 if isinstance(e, ValidationFailed) else 1)


def _run(fn: Any) -> Any:
    from api.errors import UnbrokenError

    try:
        return fn()
    except UnbrokenError as e:
        raise _fail(e) from None


def _ts(t: float | None) -> str:
    return "-" if t is None else datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _fmt(v: Any, spec: str = "") -> str:
    return "-" if v is None else format(v, spec)


def _dp(p: Any) -> str:
    """The dp now / the dp the scheduler asked for ("4/2" while shrinking from 4 to 2)."""
    return f"{_fmt(p.dp)}/{_fmt(p.target_dp)}"


def _watch(c: Client, job_id: str) -> Any:
    """A live bar until the job finishes: step/total, loss, tokens/s, dp, recoveries (rec)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from service.statuses import PENDING

    console = Console(stderr=True)
    columns = (BarColumn(bar_width=12), TextColumn("{task.fields[info]}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(job_id, total=None, info=PENDING)

        def update(p: JobProgress) -> None:
            step = f"{p.step or 0}/{p.total_steps}" if p.total_steps else str(p.step or 0)
            info = (f"{p.status} {step} loss {_fmt(p.loss, '.4f')} "
                    + (f"eval {_fmt(p.eval_loss, '.4f')} " if p.eval_loss is not None else "")
                    + f"tok/s {_fmt(p.tokens_per_s, ',.0f')} dp {_fmt(p.dp)} rec {p.recoveries}")
            bar.update(task, total=p.total_steps, completed=p.step or 0, info=info)

        return c.wait(job_id, progress_callback=update, poll_s=1.0, raise_on_failure=False)


def submit(
    job_file: str = typer.Argument(..., help="a job.yaml (or .json)"),
    wait: bool = typer.Option(False, "--wait", help="follow the job with a live progress bar until it ends"),
    idempotency_key: str = typer.Option(None, help="resubmitting with the same key returns the same job"),
    url: str = URL,
    token: str = TOKEN,
) -> None:
    """Submit a job; prints its id (with --wait, follows it and exits 0 only if it SUCCEEDED)."""
    with _client(url, token) as c:
        job = _run(lambda: c.submit(job_file, idempotency_key=idempotency_key))
        typer.echo(job.id)
        if job.estimate is not None:
            from service.estimate import human_duration

            typer.echo(f"estimate: ~{human_duration(job.estimate.duration_s)} "
                       f"(~{job.estimate.step_time_s:.3g} s a step: {job.estimate.basis})", err=True)
        for text in job.warnings:
            typer.secho(f"warning: {text}", fg=typer.colors.YELLOW, err=True)
        if not wait:
            return
        from service.statuses import SUCCEEDED

        final = _run(lambda: _watch(c, job.id))
        color = typer.colors.GREEN if final.status == SUCCEEDED else typer.colors.RED
        typer.secho(f"{final.id} {final.status}" + (f": {final.reason}" if final.reason else ""), fg=color, err=True)
        if final.status != SUCCEEDED:
            raise typer.Exit(1)


def list_jobs(
    status: str = typer.Option(None, help="comma-separated statuses, e.g. RUNNING,PENDING"),
    owner: str = typer.Option(None, help="admins: another owner's jobs"),
    name: str = typer.Option(None),
    limit: int = typer.Option(50, help="jobs a page"),
    all_pages: bool = typer.Option(False, "--all", help="every page, not only the first"),
    url: str = URL,
    token: str = TOKEN,
) -> None:
    """List jobs, newest first."""
    with _client(url, token) as c:
        if all_pages:
            jobs = _run(lambda: list(c.iter_jobs(status=status, owner=owner, name=name, limit=limit)))
            more = None
        else:
            page = _run(lambda: c.list(status=status, owner=owner, name=name, limit=limit))
            jobs, more = page.items, page.next_cursor
    rows = [("ID", "NAME", "OWNER", "STATUS", "PRIO", "STEP", "LOSS", "DP/TARGET", "CREATED (UTC)")]
    for j in jobs:
        p = j.progress
        step = "-" if p.step is None else f"{p.step}/{p.total_steps}"
        rows.append((j.id, j.name, j.owner, j.status, str(j.priority), step, _fmt(p.loss, ".4f"), _dp(p),
                     _ts(j.created_at)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        typer.echo("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
    if more:
        typer.echo("(more: --all, or raise --limit)", err=True)


def status(
    job_id: str = typer.Argument(...),
    checkpoints: bool = typer.Option(False, "--checkpoints", help="also list the job's checkpoints"),
    as_json: bool = typer.Option(False, "--json", help="the raw job as JSON"),
    url: str = URL,
    token: str = TOKEN,
) -> None:
    """One job's state and progress (with --checkpoints, its checkpoints too)."""
    with _client(url, token) as c:
        job = _run(lambda: c.get(job_id))
        cks = _run(lambda: c.checkpoints(job_id)) if checkpoints else []
        good = _run(lambda: c.goodput(job_id))
        # Warnings the job raised (e.g. in-memory snapshots kept on one node only), newest meaning last.
        evs = _run(lambda: list(c.events(job_id, follow=False)))
        warned = [e.message for e in evs if e.kind == "warning"]
        # The scheduler's decisions about the job (shrink, grow, why it waits), the newest last.
        decided = [e for e in evs if e.kind in ("shrink", "grow", "waiting")][-3:]
    if as_json:
        typer.echo(job.model_dump_json(indent=2))
        return
    p = job.progress
    lines = [
        ("id", job.id), ("name", job.name), ("owner", job.owner), ("status", job.status),
        ("reason", job.reason or "-"), ("priority", job.priority),
        ("world", f"{job.min_world}..{job.max_world if job.max_world is not None else 'fill'} workers"),
        ("step", "-" if p.step is None else f"{p.step}/{p.total_steps}"), ("loss", _fmt(p.loss, ".4f")), ("eval loss", _fmt(p.eval_loss, ".4f")),
        ("tokens/s", _fmt(p.tokens_per_s, ",.0f")), ("dp", _fmt(p.dp)), ("target dp", _fmt(p.target_dp)),
        ("world_size", _fmt(p.world_size)),
        ("generation", _fmt(p.generation)), ("recoveries", p.recoveries), ("goodput", good.summary),
        ("created", _ts(job.created_at)),
        ("started", _ts(job.started_at)), ("finished", _ts(job.finished_at)),
    ]
    for k, v in lines:
        typer.echo(f"{k:>11}: {v}")
    for w in dict.fromkeys(warned):
        typer.echo(f"{'warning':>11}: {w}")
    for e in decided:
        typer.echo(f"{'scheduler':>11}: {_ts(e.ts)} {e.kind}: {e.message}")
    if checkpoints:
        from rich.console import Console
        from rich.table import Table

        table = Table("STEP", "TIER", "URI", "TIME (UTC)")
        for ck in cks:
            table.add_row(str(ck.step), ck.tier, ck.uri, _ts(ck.ts))
        Console().print(table)


def events(
    job_id: str = typer.Argument(...),
    follow: bool = typer.Option(False, "--follow", "-f", help="stream new events until the job ends"),
    url: str = URL,
    token: str = TOKEN,
) -> None:
    """A job's events (submitted, started, failures, resizes, checkpoints, finished)."""
    from api.errors import UnbrokenError

    with _client(url, token) as c:
        try:
            for ev in c.events(job_id, follow=follow):
                typer.echo(f"{_ts(ev.ts)}  {ev.kind:<18} {ev.message}")
        except UnbrokenError as e:
            raise _fail(e) from None


def logs(
    job_id: str = typer.Argument(...),
    follow: bool = typer.Option(False, "--follow", "-f", help="keep printing new lines until the job ends"),
    url: str = URL,
    token: str = TOKEN,
) -> None:
    """A job's log lines (its workers' and supervisor's output), each prefixed with its source."""
    from api.errors import UnbrokenError

    with _client(url, token) as c:
        try:
            for x in c.logs(job_id, follow=follow):
                sys.stdout.write((f"[{x.source}] " if x.source else "") + x.line + "\n")
                sys.stdout.flush()
        except UnbrokenError as e:
            raise _fail(e) from None


def cancel(job_id: str = typer.Argument(...), url: str = URL, token: str = TOKEN) -> None:
    """Cancel a job (a queued one at once; a running one is stopped by its supervisor)."""
    with _client(url, token) as c:
        job = _run(lambda: c.cancel(job_id))
    typer.echo(f"{job.id} {job.status}" + (" (cancel requested)" if not job.terminal else ""))


def delete(job_id: str = typer.Argument(...), url: str = URL, token: str = TOKEN) -> None:
    """Delete a finished job and its events, metrics, logs and checkpoint records."""
    with _client(url, token) as c:
        _run(lambda: c.delete(job_id))
    typer.echo(f"{job_id} deleted")


def register(app: typer.Typer) -> None:
    """Add this module's commands to the CLI."""
    app.command("submit")(submit)
    app.command("list")(list_jobs)
    app.command("status")(status)
    app.command("events")(events)
    app.command("logs")(logs)
    app.command("cancel")(cancel)
    app.command("delete")(delete)
