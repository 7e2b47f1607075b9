"""`unbroken data prepare SRC OUT --tokenizer T` and `unbroken data check JOB`.

prepare: tokenizes a raw data set (JSONL, Parquet, a `datasets` save_to_disk folder or text files)
once, on every core, into a folder a job points at with `data: {kind: tokens, path: OUT}`.
Nothing here imports torch: the data modules it uses are torch-free.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from parallel.config import DataConfig
    from parallel.data.prepare import PrepareResult
    from parallel.data.tokenizer import Tokenizer

data_app = typer.Typer(help="Prepare and check training data.", no_args_is_help=True)

EXIT_INVALID = 2


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(EXIT_INVALID)


@data_app.command("prepare")
def prepare_cmd(
    src: Path = typer.Argument(..., help="a JSONL/Parquet file, a folder of them, a save_to_disk folder, or text"),
    out: Path = typer.Argument(..., help="the folder to write (must not exist)"),
    tokenizer: str | None = typer.Option(
        None, "--tokenizer", "-t", help="a tokenizer.json or a Hugging Face folder; default: byte-level"
    ),
    kind: str | None = typer.Option(None, "--kind", help="jsonl, parquet, hf_dataset or text; default: from SRC"),
    text_field: str = typer.Option("text", "--text-field", help="the field (column) holding the text"),
    fmt: str = typer.Option("text", "--format", help="text, prompt_completion or chat"),
    hf_split: str = typer.Option("train", "--hf-split", help="the split of a DatasetDict folder"),
    eos_token: str | None = typer.Option(None, "--eos-token", help="the end-of-document token; default: the tokenizer's"),
    chat_template: Path | None = typer.Option(None, "--chat-template", help="a Jinja file (format chat)"),
    on_bad_row: str = typer.Option("fail", "--on-bad-row", help="fail: stop at the first bad row; skip: drop it"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="show a progress bar"),
) -> None:
    """Tokenize SRC once into OUT: token ids, document boundaries, the tokenizer, metadata."""
    from pydantic import ValidationError

    from parallel.config import DataConfig, format_validation_error
    from parallel.data.encode import infer_kind, source_size
    from parallel.data.tokenizer import load_tokenizer
    from parallel.data.types import DataError

    try:
        src_kind = kind or infer_kind(str(src))
        template = chat_template.read_text(encoding="utf-8") if chat_template is not None else None
        cfg = DataConfig(kind=src_kind, path=str(src), text_field=text_field, format=fmt, hf_split=hf_split,
                         tokenizer=tokenizer, eos_token=eos_token, chat_template=template, on_bad_row=on_bad_row)
        if cfg.kind in ("synthetic", "tokens"):
            raise DataError(f"--kind={cfg.kind} is not raw data; use jsonl, parquet, hf_dataset or text")
        tok = load_tokenizer(tokenizer, eos_token, "--tokenizer")
        total = source_size(cfg)
    except ValidationError as e:
        raise _fail(format_validation_error(e).replace("path", "SRC")) from None
    except (DataError, OSError) as e:
        raise _fail(str(e)) from None
    typer.echo(f"tokenizing {src} ({cfg.kind}, format {cfg.format}, {total / 2**20:,.1f} MiB) with {tok.name} "
               f"({tok.vocab_size} ids, eos {tok.eos_token!r}={tok.eos_id})", err=True)
    try:
        result = _run(cfg, out, tok, total, progress and sys.stderr.isatty())
    except DataError as e:
        raise _fail(f"{e}\nnothing was written to {out}") from None
    except KeyboardInterrupt:
        raise _fail(f"interrupted; nothing was written to {out}") from None
    if result.skipped_rows:
        typer.secho(f"skipped {result.skipped_rows} bad rows, e.g.:", fg=typer.colors.YELLOW, err=True)
        for ex in result.skipped_examples:
            typer.secho(f"  {ex}", fg=typer.colors.YELLOW, err=True)
    typer.echo(f"{result.tokens:,} tokens, {result.documents:,} documents in {result.seconds:.1f}s "
               f"({result.tokens_per_s:,.0f} tokens/s) -> {result.out}")
    typer.echo(f"train on it with:  data: {{kind: tokens, path: {result.out}}}")


def _run(cfg: DataConfig, out: Path, tok: Tokenizer, total: int, bar: bool) -> PrepareResult:
    from parallel.data.prepare import prepare_dataset

    if not bar:
        return prepare_dataset(cfg, out, tok, what="SRC")
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress(TextColumn("[bold]prepare"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), transient=True) as p:
        task = p.add_task("prepare", total=total)
        return prepare_dataset(cfg, out, tok, what="SRC", progress=lambda n: p.advance(task, n))


@data_app.command("check")
def check_cmd(job_file: Path = typer.Argument(..., help="job YAML/JSON")) -> None:
    """Check a job's data section (files, tokenizer, vocabulary, fields) without starting anything."""
    from parallel.data.check import check_data
    from service.spec import SpecError, load_spec_file

    try:
        cfg = load_spec_file(job_file)
    except SpecError as e:
        raise _fail(f"{job_file}: {e}") from None
    problems = check_data(cfg)
    for p in problems:
        typer.secho(f"{p}", fg=typer.colors.RED, err=True)
    if problems:
        raise typer.Exit(EXIT_INVALID)
    typer.echo(f"{job_file}: data OK")


def register(app: typer.Typer) -> None:
    """Add this module's commands to the CLI."""
    app.add_typer(data_app, name="data")
