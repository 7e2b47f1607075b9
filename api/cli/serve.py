"""`unbroken serve` (the control plane) and `unbroken token create` (API tokens for more users)."""

from __future__ import annotations

import typer

token_app = typer.Typer(help="API tokens: each maps to a principal (user or admin).", no_args_is_help=True)


def serve(
    host: str = typer.Option("127.0.0.1", help="address to bind (keep 127.0.0.1 unless behind a proxy)"),
    port: int = typer.Option(8420, help="HTTP port"),
    db: str = typer.Option(None, help="job store URL: sqlite:///PATH or postgresql+psycopg://USER@HOST/DB "
                                      "(default: $UNBROKEN_HOME/unbroken.db)"),
    address: str = typer.Option(None, help="a running Ray cluster (ray://... or HOST:PORT); default: start one"),
    num_cpus: int = typer.Option(None, help="CPUs of the embedded Ray cluster (default: all)"),
    no_ray: bool = typer.Option(False, "--no-ray", help="store only: accept and serve jobs but never run them"),
    dashboard: bool = typer.Option(False, help="start the Ray dashboard with the embedded cluster"),
    quota_jobs: int = typer.Option(None, help="per-owner limit on running jobs"),
    quota_workers: int = typer.Option(None, help="per-owner limit on running workers"),
) -> None:
    """Run the API server and scheduler; writes an admin token file the SDK and CLI read."""
    from api.server import PortInUseError, ServeOptions, run_server

    try:
        run_server(ServeOptions(host=host, port=port, db=db, address=address, num_cpus=num_cpus, no_ray=no_ray,
                                dashboard=dashboard, quota_jobs=quota_jobs, quota_workers=quota_workers))
    except PortInUseError as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None


@token_app.command("create")
def token_create(
    principal: str = typer.Argument(..., help="who the token speaks for (a job's owner)"),
    role: str = typer.Option("user", help="user (own jobs only) or admin (all jobs)"),
    db: str = typer.Option(None, help="job store URL (default: $UNBROKEN_HOME/unbroken.db)"),
) -> None:
    """Create a token for PRINCIPAL and print it (only its hash is stored: keep it)."""
    from api.server import default_db_url, normalize_db_url
    from service.store import JobStore

    if role not in ("user", "admin"):
        raise typer.BadParameter(f"role {role!r} must be user or admin", param_hint="--role")
    store = JobStore(normalize_db_url(db or default_db_url()))
    try:
        typer.echo(store.create_token(principal, role, label="unbroken token create"))
    finally:
        store.close()


def register(app: typer.Typer) -> None:
    """Add this module's commands to the CLI."""
    app.command("serve")(serve)
    app.add_typer(token_app, name="token")
