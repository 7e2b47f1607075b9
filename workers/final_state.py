"""The final state of a local run (`<run>/final/`), and reading it as an `export-hf` source.

`final/model.safetensors` holds the full model tensors in our naming and `final/config.json`
the run's EngineConfig: enough to rebuild the model or export it with `export-hf`
(workers/export_resolver.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from parallel.config import EngineConfig
from workers.export_source import ExportOptions, ExportSource, check_given_model, recorded_tokenizer

FINAL_DIR = "final"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


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


def resolve_final_state(source: str, opts: ExportOptions) -> ExportSource | None:
    """The final state of a run folder (or of its final/ itself), or None when `source` is not one."""
    if opts.step is not None:
        return None  # a step names a checkpoint: a run folder's checkpoints/ (see checkpoint_export)
    p = Path(source)
    for candidate in (p, p / FINAL_DIR):
        if is_final_dir(candidate):
            state, cfg = load_final_state(candidate)
            check_given_model(cfg.model, opts, str(candidate / CONFIG_FILE))
            return ExportSource(state, cfg.model, f"final state in {candidate}", (),
                                recorded_tokenizer(cfg.model_dump(mode="json")))
    return None
