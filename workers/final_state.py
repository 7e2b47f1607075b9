"""The final state of a local run (`<run>/final/`) and resolving export sources.

`final/model.safetensors` holds the full model tensors in our naming and `final/config.json`
the run's EngineConfig: enough to rebuild the model or export it with `export-hf`.
`resolve_export_source` turns what a user names (a run folder, its final folder, a persistent
checkpoint: see workers/checkpoint_export.py) into an ExportSource; each kind of source is one
of EXPORT_RESOLVERS.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from parallel.config import EngineConfig, ModelConfig, format_validation_error

FINAL_DIR = "final"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


class ExportSourceError(ValueError):
    """A source that is not a run, a final folder or a checkpoint; the message says what is accepted."""


@dataclass(frozen=True)
class ExportOptions:
    """What `export-hf` is told besides the source (resolvers ignore what is not theirs)."""

    step: int | None = None  # a checkpoint's step; None: the newest valid one
    endpoint_url: str | None = None  # S3 endpoint for s3:// sources
    region: str | None = None
    model_config: str | None = None  # a job YAML/JSON whose `model` section describes the model


class ExportSource(NamedTuple):
    state: dict[str, torch.Tensor]  # full tensors in our naming
    model: ModelConfig
    origin: str  # what was read, for the user: "final state in ...", "checkpoint ... (step N)"
    notes: tuple[str, ...] = ()  # e.g. newer checkpoints that were skipped, and why


def save_final_state(state: dict[str, torch.Tensor], cfg: EngineConfig, out_dir: str | Path) -> Path:
    """Write full tensors + config; written to a temp name then renamed, so a half-written file never shows."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Cloned so tied tensors (embedding = output) do not share storage, which safetensors refuses.
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
    tmp = out / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt", "producer": "unbroken"})
    tmp.replace(out / WEIGHTS_FILE)
    (out / CONFIG_FILE).write_text(cfg.model_dump_json(indent=2) + "\n", encoding="utf-8")
    return out


def is_final_dir(path: str | Path) -> bool:
    p = Path(path)
    if not ((p / WEIGHTS_FILE).is_file() and (p / CONFIG_FILE).is_file()):
        return False
    try:
        return "model" in json.loads((p / CONFIG_FILE).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, OSError):
        return False


def load_final_state(path: str | Path) -> tuple[dict[str, torch.Tensor], EngineConfig]:
    from safetensors.torch import load_file

    p = Path(path)
    cfg = EngineConfig.model_validate_json((p / CONFIG_FILE).read_text(encoding="utf-8"))
    return load_file(str(p / WEIGHTS_FILE)), cfg


def model_config_from_file(path: str | Path) -> ModelConfig:
    """The `model` section of a job YAML/JSON (or of a run's final/config.json), for `--model-config`."""
    import yaml
    from pydantic import ValidationError

    p = Path(path)
    if not p.is_file():
        raise ExportSourceError(f"--model-config {str(p)!r} does not exist; give the job's YAML/JSON file")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ExportSourceError(f"--model-config {str(p)!r} is not valid YAML or JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise ExportSourceError(
            f"--model-config {str(p)!r} has no `model` section; give the job file the model was trained with "
            "(or a run's final/config.json)"
        )
    try:
        return ModelConfig.model_validate(data["model"])
    except ValidationError as e:
        raise ExportSourceError(
            f"--model-config {str(p)!r} is not a valid model:\n{format_validation_error(e, 'model')}"
        ) from None


# What the exported folder depends on: a --model-config must agree on these with a recorded config.
_EXPORTED_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "kv_heads", "ffn_dim", "norm_eps", "rope_theta",
                    "max_seq_len", "tie_embeddings", "moe")  # fmt: skip


def check_given_model(recorded: ModelConfig, opts: ExportOptions, where: str) -> None:
    """Refuse a --model-config that contradicts the config the source records (it would mislabel the weights)."""
    if opts.model_config is None:
        return
    given = model_config_from_file(opts.model_config)
    diffs = [
        f"{f}: {where} has {getattr(recorded, f)}, --model-config has {getattr(given, f)}"
        for f in _EXPORTED_FIELDS
        if getattr(recorded, f) != getattr(given, f)
    ]
    if diffs:
        raise ExportSourceError(
            f"--model-config {opts.model_config!r} contradicts the model config recorded in {where}; "
            "drop --model-config (it is only needed where none is recorded):\n  " + "\n  ".join(diffs)
        )


def _local_run(source: str, opts: ExportOptions) -> ExportSource | None:
    if opts.step is not None:
        return None  # a step names a checkpoint: a run folder's checkpoints/ (see checkpoint_export)
    p = Path(source)
    for candidate in (p, p / FINAL_DIR):
        if is_final_dir(candidate):
            state, cfg = load_final_state(candidate)
            check_given_model(cfg.model, opts, str(candidate / CONFIG_FILE))
            return ExportSource(state, cfg.model, f"final state in {candidate}")
    return None


def _checkpoint(source: str, opts: ExportOptions) -> ExportSource | None:
    from workers.checkpoint_export import resolve_checkpoint  # lazy: it imports boto3 and DCP

    return resolve_checkpoint(source, opts)


Resolver = Callable[[str, ExportOptions], ExportSource | None]
# Each resolver returns an ExportSource, None when the source is not its kind, or raises
# ExportSourceError when it is its kind but cannot be exported (the message says why and the fix).
EXPORT_RESOLVERS: list[Resolver] = [_local_run, _checkpoint]


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
