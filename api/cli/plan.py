"""`unbroken plan job.yaml --gpus N`: which layouts fit, how fast each should run, and why others don't.

Pure arithmetic from the planner (parallel/planner); imports neither torch nor ray.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    """Add this module's commands to the CLI."""
    app.command(name="plan")(plan_command)


def plan_command(
    job: Path = typer.Argument(..., help="job file (YAML or JSON)"),
    gpus: int = typer.Option(..., "--gpus", help="devices in all"),
    gpu: str = typer.Option("h100", "--gpu", help="hardware preset: h100, h200, a100, cpu"),
    nodes: int | None = typer.Option(None, "--nodes", help="nodes (default: as few full nodes as fit)"),
    explain: bool = typer.Option(False, "--explain", help="show each formula with its numbers"),
    top: int = typer.Option(10, "--top", help="candidates to list"),
    max_rejected: int = typer.Option(15, "--rejected", help="rejected layouts to list"),
    as_json: bool = typer.Option(False, "--json", help="print the plan as JSON (what POST /v1/plan returns)"),
    activations: str = typer.Option(
        "engine", "--activations",
        help="activation model: engine (this engine's saved tensors) or korthikanti (sbh·34 per layer; the 5as/h scores term is dropped: fused attention keeps no scores)",
    ),
) -> None:
    """Rank the layouts that fit by estimated tokens/s; show the best one's memory and each rejection's reason."""
    from rich.console import Console
    from rich.table import Table

    from parallel.planner.explain import explain as explain_lines
    from parallel.planner.hardware import PlanError, make_cluster
    from parallel.planner.report import result_to_dict
    from parallel.planner.search import Candidate, plan
    from parallel.planner.terms import fmt_bytes, fmt_time
    from service.spec import SpecError, load_spec_file

    console = Console()
    try:
        spec = load_spec_file(job)
    except SpecError as e:
        console.print(f"[red]invalid job file {job}:[/red]\n{e}")
        raise typer.Exit(2) from None
    try:
        cluster = make_cluster(gpus, gpu, nodes)
    except PlanError as e:
        console.print(f"[red]cannot plan:[/red] {e}")
        raise typer.Exit(2) from None
    if activations not in ("engine", "korthikanti"):
        console.print(f"[red]--activations {activations!r}:[/red] use engine or korthikanti")
        raise typer.Exit(2)
    result = plan(spec, cluster, activation_model=activations)
    if as_json:
        typer.echo(json.dumps(result_to_dict(result, top=top, max_rejected=max_rejected), indent=2))
        raise typer.Exit(0 if result.ok else 1)

    console.print(f"[bold]{spec.name}[/bold]: model {spec.model.preset or 'custom'}, seq {spec.training.seq_len}, "
                  f"global batch {spec.training.global_batch_size}, {spec.training.dtype}, "
                  f"AC {spec.training.activation_checkpointing} on {cluster.describe()}")
    for err in result.errors:
        console.print(f"[red]impossible:[/red] {err}")
    if result.candidates:
        t = Table(title="layouts that fit, fastest first")
        for col in ("#", "layout", "tokens/s", "step", "MFU", "peak memory / device"):
            t.add_column(col, justify="right" if col not in ("layout",) else "left")
        for i, c in enumerate(result.candidates[:top], 1):
            t.add_row(str(i), c.layout.label(), f"{c.tokens_per_s:,.0f}", fmt_time(c.step_time),
                      f"{c.time.mfu:.2f}", f"{fmt_bytes(c.memory.peak)} / {fmt_bytes(c.memory.capacity)}")
        console.print(t)
        if len(result.candidates) > top:
            console.print(f"... and {len(result.candidates) - top} more that fit (--top N)")
    req = result.requested
    if req is not None:
        if isinstance(req, Candidate):
            rank = next((i for i, c in enumerate(result.candidates, 1) if c.layout == req.layout), None)
            console.print(f"the job's own layout [bold]{req.layout.label()}[/bold] fits: "
                          f"{req.tokens_per_s:,.0f} tokens/s" + (f" (rank {rank})" if rank else ""))
        else:
            console.print(f"[red]the job's own layout {req.label} does not fit:[/red] " + "; ".join(req.reasons))
    best = result.best
    if best is not None:
        m = Table(title=f"memory per device of the best: {best.layout.label()} (worst rank: {best.memory.rank})")
        m.add_column("item")
        m.add_column("bytes", justify="right")
        m.add_column("formula")
        for section, terms in (("", best.memory.persistent), ("fwd/bwd ", best.memory.fwd_bwd),
                               ("optimizer step ", best.memory.optimizer_step), ("host ", best.memory.host)):
            for term in terms:
                m.add_row(section + term.name, fmt_bytes(term.value), term.formula)
        m.add_row("[bold]peak[/bold]", f"[bold]{fmt_bytes(best.memory.peak)}[/bold]",
                  f"of {fmt_bytes(best.memory.capacity)} usable")
        console.print(m)
        if explain:
            console.print("\n".join(explain_lines(best, spec.model, spec.training)), markup=False, highlight=False)
    if result.rejected:
        r = Table(title=f"rejected layouts ({len(result.rejected)})")
        r.add_column("layout")
        r.add_column("reason")
        for rej in sorted(result.rejected, key=lambda x: x.memory.peak if x.memory else 0)[:max_rejected]:
            r.add_row(rej.label, "\n".join(rej.reasons))
        console.print(r)
    if best is None:
        console.print("[red]no layout fits.[/red] " + " ".join(result.reasons(3)))
        raise typer.Exit(1)
