"""`unbroken train` (the engine on this machine, N processes, no Ray) and `unbroken export-hf`.

Heavy imports (torch, the launcher) happen inside the commands so `unbroken --help` stays fast.
"""

from __future__ import annotations

from pathlib import Path

import typer

# Exit codes: 2 = the job was refused before anything started; 1 = the run failed.
EXIT_INVALID = 2
EXIT_FAILED = 1


def _fail(message: str, code: int) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def train(
    job_file: Path = typer.Argument(..., help="job YAML/JSON, the same file `unbroken run`/`submit` take; train "
                                    "uses its sections model, data, training, parallelism"),
    nproc: int = typer.Option(1, "--nproc", "-n", help="processes (ranks) on this machine"),
    output: Path | None = typer.Option(None, "--output", "-o", help="run folder; default: training.output_dir, else a fresh runs/train-<time>"),
    device: str = typer.Option("auto", help="cpu, cuda, or auto (cuda when present)"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="show a progress bar"),
) -> None:
    """Train on this machine in NPROC processes (our own launcher; no Ray, no torchrun)."""
    from workers.launcher import LaunchConfigError, LocalLauncher, RankFailure

    try:
        cfg, unused = _engine_of_job_file(job_file)
        launcher = LocalLauncher(cfg, nproc, output, device=device, show_progress=progress)
    except (ValueError, LaunchConfigError) as e:  # service.spec.SpecError is a ValueError
        _fail(f"{job_file} was refused, nothing started:\n{e}", EXIT_INVALID)
    if unused:
        typer.secho(f"note: `unbroken train` does not use the section(s) {', '.join(unused)} of {job_file.name} "
                    "(they are for `unbroken run` and `unbroken submit`)", fg=typer.colors.YELLOW, err=True)
    try:
        result = launcher.run()
    except RankFailure as e:
        _fail(str(e), EXIT_FAILED)
    except KeyboardInterrupt:
        _fail("interrupted; all ranks were stopped", 130)
    last = result.last or {}
    typer.echo(
        f"done: {result.steps} steps in {result.wall_s:.1f}s"
        + (f", final loss {last['loss']:.4f}, {last['tokens_per_s']:,.0f} tokens/s" if last else "")
    )
    typer.echo(f"metrics: {result.metrics_path}")
    if result.final_dir is not None:
        typer.echo(f"final state: {result.final_dir}  (export with: unbroken export-hf {result.output_dir} OUT_DIR)")


def _engine_of_job_file(job_file: Path) -> tuple[object, list[str]]:
    """The engine config of a job file, validated as the whole job first (so train, run and submit
    accept and refuse the same files), and the job's sections train does not use."""
    import yaml

    from parallel.config import EngineConfig
    from service.spec import load_spec_file, parse_spec

    load_spec_file(job_file)  # the job as run/submit read it: every section checked
    sections = yaml.safe_load(job_file.read_text(encoding="utf-8")) or {}  # a mapping: checked just now
    engine = set(EngineConfig.model_fields)
    cfg = parse_spec({k: v for k, v in sections.items() if k in engine}, cls=EngineConfig)
    return cfg, sorted(k for k in sections if k not in engine)


def export_hf_cmd(
    source: str = typer.Argument(
        ...,
        help="a run folder (from `unbroken train`) or its final/ folder; or persistent checkpoints: "
        "file:///path, a local checkpoint root, s3://bucket/prefix (optionally ending in step-NNNNNNNN)",
    ),
    out_dir: Path = typer.Argument(..., help="where to write the Hugging Face folder"),
    step: int | None = typer.Option(
        None, "--step", min=0, help="export this checkpoint step (default: the newest valid checkpoint)"
    ),
    model_config: Path | None = typer.Option(
        None, "--model-config", help="job YAML/JSON whose `model` section describes the model, for "
        "checkpoints that do not record it",
    ),
    endpoint_url: str | None = typer.Option(
        None, "--endpoint-url", help="S3 endpoint, e.g. http://127.0.0.1:8333 (or AWS_ENDPOINT_URL)"
    ),
    region: str | None = typer.Option(None, "--region", help="S3 region (or AWS_REGION)"),
    tokenizer: str | None = typer.Option(
        None, "--tokenizer", help="a tokenizer.json or folder (e.g. a prepared data set's tokenizer/) to write beside "
        "the weights, so AutoTokenizer loads the folder too; default: the one the job trained with, if recorded",
    ),
) -> None:
    """Export a run's final weights or a checkpoint's model as a Hugging Face folder of the model's
    family (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM)."""
    from parallel.hf import HFInteropError, export_hf, hf_config_dict
    from workers.export_resolver import resolve_export_source
    from workers.export_source import ExportOptions, ExportSourceError

    opts = ExportOptions(step=step, endpoint_url=endpoint_url, region=region,
                         model_config=str(model_config) if model_config is not None else None)  # fmt: skip
    try:
        found = resolve_export_source(source, opts)
        tokenizer = tokenizer or found.tokenizer
        export_hf(found.state, found.model, str(out_dir), tokenizer=tokenizer)
    except (ExportSourceError, HFInteropError, ValueError) as e:
        _fail(str(e), EXIT_INVALID)
    for note in found.notes:
        typer.secho(f"note: {note}", fg=typer.colors.YELLOW, err=True)
    arch = hf_config_dict(found.model)["architectures"][0]
    typer.echo(f"exported {found.origin}")
    typer.echo(f"wrote {out_dir}/config.json and {out_dir}/model.safetensors ({arch})"
               + (f" and the tokenizer ({tokenizer})" if tokenizer else ""))


def register(app: typer.Typer) -> None:
    """Add this module's commands to the CLI."""
    app.command("train")(train)
    app.command("export-hf")(export_hf_cmd)
