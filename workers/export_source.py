"""What `export-hf` reads: an ExportSource (full tensors in our naming, the model config, where they
came from), the options it is given, and its refusals. Each kind of source resolves to one
(workers/final_state.py: a run's final state; workers/checkpoint_export.py: a persistent
checkpoint); workers/export_resolver.py tries them in turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from parallel.config import ModelConfig, format_validation_error


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
    tokenizer: str | None = None  # the tokenizer the job trained with (written beside the weights), if any


def recorded_tokenizer(engine: dict[str, Any] | None) -> str | None:
    """The tokenizer a recorded engine config trained with: data.tokenizer, or the one a prepared data folder
    carries; None for byte-level data (or when it is no longer on this machine: then --tokenizer says it)."""
    data = (engine or {}).get("data")
    if not isinstance(data, dict):
        return None
    from parallel.config import DataConfig
    from parallel.data.corpus import is_prepared, prepared_tokenizer

    try:
        cfg = DataConfig.model_validate(data)
        path = cfg.tokenizer
        if path is None and cfg.kind == "tokens" and cfg.path and is_prepared(cfg.path):
            path = prepared_tokenizer(cfg.path)
    except (ValueError, OSError):
        return None
    return str(path) if path is not None and Path(path).expanduser().exists() else None


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
                    "max_seq_len", "tie_embeddings", "moe", "head_dim", "qkv_bias", "qk_norm", "family")  # fmt: skip


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
