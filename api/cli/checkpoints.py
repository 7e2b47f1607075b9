"""`unbroken checkpoints list|verify URI`: inspect persistent checkpoints without torch.

URI is file:///path, a plain path, or s3://bucket/prefix. S3 credentials come from the standard
chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws, instance roles); the endpoint from
--endpoint-url or AWS_ENDPOINT_URL. Nothing here imports torch (or checkpointing modules that do).
"""

from __future__ import annotations

import datetime as _dt
import json

import typer

checkpoints_app = typer.Typer(help="Inspect and verify persistent checkpoints.", no_args_is_help=True)

_ENDPOINT = typer.Option(
    None, "--endpoint-url", help="S3 endpoint, e.g. http://127.0.0.1:8333 (or AWS_ENDPOINT_URL)"
)
_REGION = typer.Option(None, "--region", help="S3 region (or AWS_REGION)")


def _open(uri: str, endpoint_url: str | None, region: str | None):  # noqa: ANN202 - an ObjectStore
    from checkpointing.config import S3Config
    from checkpointing.uri import open_store

    try:
        return open_store(uri, S3Config(endpoint_url=endpoint_url, region=region))
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _layout(layout: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(layout.items())) or "-"


@checkpoints_app.command("list")
def list_cmd(
    uri: str = typer.Argument(..., help="file:///path or s3://bucket/prefix"),
    endpoint_url: str | None = _ENDPOINT,
    region: str | None = _REGION,
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """List checkpoints: step, generation, world layout, size, and whether each is valid (or why not).

    Validity here is the cheap check (manifest, files present with the right sizes, fencing);
    `verify` re-hashes the bytes.
    """
    from checkpointing.catalog import list_checkpoints
    from checkpointing.object_store import StorageError

    store = _open(uri, endpoint_url, region)
    try:
        infos = list_checkpoints(store)
    except StorageError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        rows = [{"step": i.step, "generation": i.generation, "world_size": i.world_size, "layout": i.layout,
                 "bytes": i.total_bytes, "valid": i.valid, "reason": i.reason,
                 "created_at": i.manifest.created_at if i.manifest else None} for i in infos]  # fmt: skip
        typer.echo(json.dumps(rows, indent=1))
        return
    if not infos:
        typer.echo(f"no checkpoints under {store.root_uri}")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"checkpoints under {store.root_uri}")
    for col in ("step", "generation", "world", "layout", "size", "created (UTC)", "valid"):
        table.add_column(col)
    for i in infos:
        created = (
            _dt.datetime.fromtimestamp(i.manifest.created_at, _dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
            if i.manifest
            else "-"
        )
        table.add_row(
            str(i.step),
            "-" if i.generation is None else str(i.generation),
            "-" if i.world_size is None else str(i.world_size),
            _layout(i.layout),
            _size(i.total_bytes) if i.manifest else "-",
            created,
            "yes" if i.valid else f"no: {i.reason}",
        )
    Console(width=200).print(table)


@checkpoints_app.command("verify")
def verify_cmd(
    uri: str = typer.Argument(..., help="file:///path or s3://bucket/prefix"),
    step: int | None = typer.Option(None, "--step", help="verify this step only (default: every checkpoint)"),
    endpoint_url: str | None = _ENDPOINT,
    region: str | None = _REGION,
) -> None:
    """Re-hash every file of the checkpoint(s) against the manifest; exit 1 on any mismatch."""
    from checkpointing.catalog import list_checkpoints, verify_checkpoint, verify_files
    from checkpointing.object_store import StorageError

    store = _open(uri, endpoint_url, region)
    bad = 0
    try:
        if step is not None:
            reports = [verify_checkpoint(store, step)]
        else:
            reports = []
            for info in list_checkpoints(store):
                if info.manifest is None:
                    typer.echo(f"step {info.step}: skipped ({info.reason})")
                    continue
                reports.append(verify_files(store, info))
    except StorageError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if not reports:
        typer.echo(f"no complete checkpoints under {store.root_uri}", err=True)
        raise typer.Exit(1)
    for rep in reports:
        if rep.ok:
            typer.echo(
                f"step {rep.step}: OK ({rep.files_checked} files, {_size(rep.bytes_checked)} re-hashed)"
            )
        else:
            bad += 1
            typer.echo(f"step {rep.step}: FAILED")
            for p in rep.problems:
                typer.echo(f"  {p}")
    if bad:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the CLI."""
    app.add_typer(checkpoints_app, name="checkpoints")
