"""The `unbroken` command. Each command group lives in its own module of this package.

Nothing here imports torch or ray at import time: `unbroken --help` must answer fast.
Command modules import the heavy parts inside their command functions.
"""

from __future__ import annotations

import typer

from api.cli import checkpoints, data, engine, jobs, plan, run, serve

app = typer.Typer(
    name="unbroken",
    help="Unbroken: elastic, fault-tolerant LLM training on Ray.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)



@app.command()
def version() -> None:
    """Print Unbroken's version."""
    from importlib.metadata import version as pkg_version

    typer.echo(pkg_version("unbroken"))


for module in (engine, run, serve, jobs, plan, checkpoints, data):
    module.register(app)


def main() -> None:
    app()
