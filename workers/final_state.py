"""The final state of a local run (`<run>/final/`) and resolving export sources.

`final/model.safetensors` holds the full model tensors in our naming and `final/config.json`
the run's EngineConfig: enough to rebuild the model or export it with `export-hf`.
`resolve_export_source` turns what a user names (a run folder, its final folder) into
(state, ModelConfig); more kinds of source (checkpoint URIs) are added to EXPORT_RESOLVERS.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from parallel.config import EngineConfig, ModelConfig

FINAL_DIR = "final"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


class ExportSourceError(ValueError):
    """A source that is not a run, a final folder or a checkpoint; the message says what is accepted."""


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


def _local_run(source: str) -> tuple[dict[str, torch.Tensor], ModelConfig] | None:
    p = Path(source)
    for candidate in (p, p / FINAL_DIR):
        if is_final_dir(candidate):
            state, cfg = load_final_state(candidate)
            return state, cfg.model
    return None


# Each resolver returns (state, model config), or None when the source is not its kind.
EXPORT_RESOLVERS: list[Callable[[str], tuple[dict[str, torch.Tensor], ModelConfig] | None]] = [_local_run]


def resolve_export_source(source: str) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """(full tensors in our naming, model config) from a run folder or its `final/` folder."""
    for resolver in EXPORT_RESOLVERS:
        found = resolver(source)
        if found is not None:
            return found
    raise ExportSourceError(
        f"{source!r} is not a finished run: expected a run folder with final/{WEIGHTS_FILE} and "
        f"final/{CONFIG_FILE} (written by `unbroken train`), or that final/ folder itself"
    )
