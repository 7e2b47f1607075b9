"""Where a job's state lives: one folder and one checkpoint root of its own (the only place this rule is).

- output: `training.output_dir` when the spec names one (a relative path under `runs_root`), else
  `<runs_root>/<job-id>`; `unbroken serve` passes `$UNBROKEN_HOME/runs`.
- checkpoints: `<checkpoint.uri>/<job-id>` when the spec names a root (so jobs sharing a bucket never
  read, overwrite or prune each other's), else `<output>/checkpoints`.
- ownership: the output folder carries a marker with its job's id; a job never writes into a folder
  marked by another job (it fails at start, naming both), so nothing of one job is touched by another.

Resuming another run is explicit: `checkpoint.resume_from`, read only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

OWNER_MARKER = ".unbroken-job"


class FolderTaken(RuntimeError):
    """The output folder belongs to another job."""


def resolve_job_paths(spec: Any, job_id: str, runs_root: str | Path) -> Any:
    """A copy of `spec` (a JobSpec) with its own output folder and checkpoint root filled in."""
    out = spec.model_copy(deep=True)
    root = Path(runs_root).expanduser()
    given = out.training.output_dir
    folder = Path(given).expanduser() if given else Path(job_id)
    out.training.output_dir = str((folder if folder.is_absolute() else root / folder).resolve())
    uri = out.checkpoint.uri
    if uri and not uri.rstrip("/").endswith(f"/{job_id}"):
        out.checkpoint.uri = f"{uri.rstrip('/')}/{job_id}"
    return out


def claim_folder(output_dir: str | Path, job_id: str) -> Path:
    """Mark `output_dir` as `job_id`'s (creating it); FolderTaken if another job's marker is there.

    The same job may claim its folder again (a restarted supervisor, `unbroken run --output` resuming).
    """
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / OWNER_MARKER
    owner = folder_owner(folder)
    if owner is not None and owner != job_id:
        raise FolderTaken(
            f"training.output_dir {folder} belongs to job {owner}; leave output_dir unset for a folder of this "
            f"job's own, or name a new folder (to start from that job's checkpoints: checkpoint.resume_from)"
        )
    if owner is None:
        marker.write_text(job_id + "\n")
    return folder


def folder_owner(output_dir: str | Path) -> str | None:
    """The id of the job that owns a folder, or None."""
    marker = Path(output_dir) / OWNER_MARKER
    try:
        return marker.read_text().strip() or None
    except OSError:
        return None
