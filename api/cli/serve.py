"""`unbroken serve` (the control plane) and `unbroken token create/list/revoke` (API tokens).

Token commands go through the API as an admin (URL and token from --url/--token, $UNBROKEN_URL/
$UNBROKEN_TOKEN or the token file), or, with --db, straight to the job store (an operator on the
server's host before any admin token exists)."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

import typer

token_app = typer.Typer(help="API tokens: each maps to a principal (user or admin); they expire and are revoked.",
                        no_args_is_help=True)

URL = typer.Option(None, "--url", envvar="UNBROKEN_URL", help="API URL(s), comma-separated (default: the token file)")
TOKEN = typer.Option(None, "--token", envvar="UNBROKEN_TOKEN", help="an admin's token (default: the token file)")
DB = typer.Option(None, help="work on this job store directly (sqlite:///PATH or postgresql+psycopg://...) "
                             "instead of through the API")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """"3600", "90m", "12h", "30d", "2w" -> seconds; else BadParameter naming the option and the form."""
    m = _DURATION.match(text)
    if m is None or float(m.group(1)) <= 0:
        raise typer.BadParameter(f"{text!r} is not a duration: write a positive number with an optional unit "
                                 "s, m, h, d or w (e.g. 30d)", param_hint="--expires-in")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


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
    tls_cert: str = typer.Option(None, "--tls-cert", help="PEM certificate (chain): serve HTTPS (with --tls-key)"),
    tls_key: str = typer.Option(None, "--tls-key", help="PEM private key of --tls-cert"),
) -> None:
    """Run the API server and scheduler; writes an admin token file the SDK and CLI read."""
    from api.server import PortInUseError, ServeOptions, run_server

    try:
        run_server(ServeOptions(host=host, port=port, db=db, address=address, num_cpus=num_cpus, no_ray=no_ray,
                                dashboard=dashboard, quota_jobs=quota_jobs, quota_workers=quota_workers,
                                tls_cert=tls_cert, tls_key=tls_key))
    except (PortInUseError, ValueError) as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None


def _store(db: str) -> Any:
    from api.server import normalize_db_url
    from service.store import JobStore

    return JobStore(normalize_db_url(db))


def _api(url: str | None, token: str | None) -> Any:
    from api.client import Client

    return Client(url, token)


def _fail(e: Exception) -> typer.Exit:
    typer.secho(f"error: {getattr(e, 'message', e)}", fg=typer.colors.RED, err=True)
    return typer.Exit(1)


def _when(ts: float | None) -> str:
    return "-" if ts is None else datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


@token_app.command("create")
def token_create(
    principal: str = typer.Argument(..., help="who the token speaks for (a job's owner)"),
    role: str = typer.Option("user", help="user (own jobs only) or admin (all jobs)"),
    label: str = typer.Option(None, help="a note shown by `token list`"),
    expires_in: str = typer.Option(None, "--expires-in", help="lifetime: 3600, 90m, 12h, 30d, 2w (default: never)"),
    weight: float = typer.Option(1.0, "--weight", help="the owner's fair share of spare capacity (2: twice the "
                                 "share of an owner with 1); the owner's weight is the largest of its tokens'"),
    db: str = DB,
    url: str = URL,
    token: str = TOKEN,
) -> None:
    """Create a token for PRINCIPAL and print it (only its hash is stored: keep it)."""
    from api.errors import UnbrokenError

    if role not in ("user", "admin"):
        raise typer.BadParameter(f"role {role!r} must be user or admin", param_hint="--role")
    seconds = None if expires_in is None else parse_duration(expires_in)
    from service.auth import check_weight

    try:
        check_weight(weight)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--weight") from None
    if db:
        store = _store(db)
        try:
            typer.echo(store.create_token(principal, role, label=label or "unbroken token create",
                                          expires_in_s=seconds, created_by="unbroken token create --db",
                                          weight=weight))
        except ValueError as e:
            raise _fail(e) from None
        finally:
            store.close()
        return
    try:
        with _api(url, token) as c:
            typer.echo(c.create_token(principal, role=role, label=label, expires_in_s=seconds, weight=weight)["token"])
    except UnbrokenError as e:
        raise _fail(e) from None


@token_app.command("list")
def token_list(
    principal: str = typer.Option(None, help="only this principal's tokens"),
    all_: bool = typer.Option(False, "--all", help="also revoked tokens"),
    db: str = DB,
    url: str = URL,
    token: str = TOKEN,
) -> None:
    """List tokens: id, principal, role, weight, created, expires, revoked, label (never the token text)."""
    from api.errors import UnbrokenError

    if db:
        store = _store(db)
        try:
            rows = [r.__dict__ for r in store.list_tokens(principal=principal, include_revoked=all_)]
        finally:
            store.close()
    else:
        try:
            with _api(url, token) as c:
                rows = c.tokens(principal=principal, include_revoked=all_)
        except UnbrokenError as e:
            raise _fail(e) from None
    typer.echo(f"{'ID':>5}  {'PRINCIPAL':20} {'ROLE':6} {'WEIGHT':>6} {'CREATED':21} {'EXPIRES':21} {'REVOKED':21} "
               "LABEL")
    for r in rows:
        typer.echo(f"{r['id']:>5}  {r['principal'][:20]:20} {r['role']:6} {r.get('weight', 1.0):>6g} "
                   f"{_when(r['created_at']):21} "
                   f"{_when(r['expires_at']):21} {_when(r['revoked_at']):21} {r['label'] or ''}")


@token_app.command("revoke")
def token_revoke(
    token_id: int = typer.Argument(..., help="the token's id (from `unbroken token list`)"),
    db: str = DB,
    url: str = URL,
    token: str = TOKEN,
) -> None:
    """Revoke a token at once: requests and console sessions with it are refused from now on."""
    from api.errors import UnbrokenError

    if db:
        store = _store(db)
        try:
            ok = store.revoke_token(token_id)
        finally:
            store.close()
        if not ok:
            raise _fail(ValueError(f"no unrevoked token with id {token_id}; see `unbroken token list --all`"))
    else:
        try:
            with _api(url, token) as c:
                c.revoke_token(token_id)
        except UnbrokenError as e:
            raise _fail(e) from None
    typer.echo(f"revoked token {token_id}")


def register(app: typer.Typer) -> None:
    """Add this module's commands to the CLI."""
    app.command("serve")(serve)
    app.add_typer(token_app, name="token")
