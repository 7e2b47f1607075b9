"""`export-hf`'s sources: turn what a user names (a run folder, its final folder, a persistent
checkpoint) into an ExportSource. Each kind of source is one of EXPORT_RESOLVERS.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from workers.export_source import ExportOptions, ExportSource, ExportSourceError
from workers.final_state import CONFIG_FILE, WEIGHTS_FILE, resolve_final_state


def _checkpoint(source: str, opts: ExportOptions) -> ExportSource | None:
    from workers.checkpoint_export import resolve_checkpoint  # lazy: it imports boto3 and DCP

    return resolve_checkpoint(source, opts)


Resolver = Callable[[str, ExportOptions], ExportSource | None]
# Each resolver returns an ExportSource, None when the source is not its kind, or raises
# ExportSourceError when it is its kind but cannot be exported (the message says why and the fix).
EXPORT_RESOLVERS: list[Resolver] = [resolve_final_state, _checkpoint]


def resolve_export_source(source: str, opts: ExportOptions | None = None) -> ExportSource:
    """Full tensors in our naming and the model config, from a run, its `final/` or a checkpoint."""
    opts = opts or ExportOptions()
    for resolver in EXPORT_RESOLVERS:
        found = resolver(source, opts)
        if found is not None:
            return found
    missing = "://" not in source and not Path(source).exists()
    raise ExportSourceError(
        (f"{source!r} does not exist, so it " if missing else f"{source!r} ")
        + f"is not a finished run or a checkpoint root: expected a run folder with final/{WEIGHTS_FILE} and "
        f"final/{CONFIG_FILE} (written by `unbroken train`), that final/ folder itself, or persistent "
        "checkpoints: file:///path, a local folder holding step-NNNNNNNN/ folders, or s3://bucket/prefix"
    )
