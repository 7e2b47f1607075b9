"""`unbroken` commands: checkpoints (filled in by the part that owns it)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this module's commands to the CLI."""
