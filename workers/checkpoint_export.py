"""Persistent checkpoints as `export-hf` sources.

Accepted: `file:///root`, a local root folder, `s3://bucket/prefix` (each may end in a step folder,
`.../step-00000100`, or take `--step N`), and a run folder's `checkpoints/` (with `--step N`, or
when the run has no final state). Without a step the newest valid checkpoint is used.

The model config comes from the manifest (the EngineConfig the state was trained with) or, for
checkpoints written before it was recorded, from `--model-config`. Only the `model.*` entries
are read, in this one process and without a process group: DCP assembles full tensors from
whatever dp/tp/pp/ep shards were saved. The reader checks each object's SHA-256 against the
manifest as it reads it, so corrupt bytes are refused (without `--step`, the next older
checkpoint is tried and the skip is reported).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from checkpointing.catalog import CheckpointInfo
from checkpointing.config import CheckpointConfig, S3Config
from checkpointing.dcp_storage import ObjectStoreReader
from checkpointing.manifest import parse_step_dir
from checkpointing.object_store import ChecksumMismatch, ObjectMissing, StorageError
from checkpointing.persistent import CheckpointManager, CorruptCheckpoint
from checkpointing.uri import parse_uri
from parallel.config import ModelConfig, format_validation_error
from parallel.model import build_model, canonical_name
from workers.export_source import (
    ExportOptions,
    ExportSource,
    ExportSourceError,
    check_given_model,
    model_config_from_file,
    recorded_tokenizer,
)

RUN_CHECKPOINTS = "checkpoints"  # where a service run keeps them by default (<output_dir>/checkpoints)
MODEL_KEY = "model"  # the model's entries in Trainer.state_dict()


def _has_steps(p: Path) -> bool:
    try:
        return p.is_dir() and any(parse_step_dir(c.name) is not None and c.is_dir() for c in p.iterdir())
    except OSError:
        return False


def _split_step(uri: str) -> tuple[str, int | None]:
    """`<root>/step-00000100` -> (`<root>`, 100); anything else -> (uri, None)."""
    head, _, last = uri.rstrip("/").rpartition("/")
    step = parse_step_dir(last)
    if step is None or head.endswith(":/") or not head:  # `s3://step-...` is a bucket, not a step
        return uri, None
    return head, step


def locate(source: str, opts: ExportOptions) -> tuple[str, int | None] | None:
    """(checkpoint root, step named by the source) when `source` names checkpoints, else None."""
    if "://" in source:
        try:
            parse_uri(source)  # refuses other schemes and relative file:// paths, naming the fix
        except ValueError as e:
            raise ExportSourceError(str(e)) from None
        root, step = _split_step(source)
        if root.startswith("file://") and not Path(root[len("file://") :]).is_dir():
            raise ExportSourceError(
                f"{root} does not exist: give the checkpoint root (the job's checkpoint.uri, "
                "which holds step-NNNNNNNN/ folders)"
            )
        return root, step
    p = Path(source)
    if parse_step_dir(p.name) is not None and p.is_dir():
        return str(p.parent.resolve()), parse_step_dir(p.name)
    if _has_steps(p):
        return str(p.resolve()), None
    # A run folder: its own checkpoints (reached with --step, or when it has no final/ state yet).
    if _has_steps(p / RUN_CHECKPOINTS):
        return str((p / RUN_CHECKPOINTS).resolve()), None
    if opts.step is not None:
        if not p.exists():
            raise ExportSourceError(f"{source!r} does not exist; give a checkpoint root or a run folder")
        raise ExportSourceError(
            f"{source!r} holds no checkpoints (no step-NNNNNNNN/ folders in it or in {RUN_CHECKPOINTS}/): "
            "--step needs a checkpoint root (file:///path, a local folder, s3://bucket/prefix) or a run folder "
            "with checkpoints"
        )
    return None


def _storage_hint(root: str) -> str:
    if root.startswith("s3://"):
        return (
            "; for S3 give --endpoint-url (or AWS_ENDPOINT_URL) and --region, and credentials in "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
        )
    return ""


def _choose(infos: list[CheckpointInfo], root: str, step: int | None) -> list[CheckpointInfo]:
    """The checkpoint(s) to try, newest first: the one asked for, or every valid one."""
    if not infos:
        raise ExportSourceError(f"no checkpoints under {root} (no step-NNNNNNNN/ folders); is it the checkpoint root?")
    steps = ", ".join(str(i.step) for i in infos if i.valid) or "none"
    if step is not None:
        found = [i for i in infos if i.step == step]
        if not found:
            raise ExportSourceError(f"no checkpoint for step {step} under {root}; valid steps there: {steps}")
        if not found[0].valid:
            raise ExportSourceError(
                f"checkpoint {found[0].uri} is not valid ({found[0].reason}); valid steps there: {steps}"
            )
        return found
    valid = [i for i in reversed(infos) if i.valid]
    if not valid:
        why = "; ".join(f"step {i.step}: {i.reason}" for i in infos)
        raise ExportSourceError(f"no valid checkpoint under {root}: {why}")
    return valid


def model_config_of(info: CheckpointInfo, opts: ExportOptions) -> ModelConfig:
    """The checkpoint's recorded model config (checked against --model-config), else --model-config."""
    assert info.manifest is not None  # only valid checkpoints get here
    recorded = info.manifest.config
    if recorded is None:
        if opts.model_config is None:
            raise ExportSourceError(
                f"checkpoint {info.uri} does not record its model config (it was written before checkpoints "
                "stored it); give the job file it was trained with: --model-config job.yaml (its `model` "
                "section is used)"
            )
        return model_config_from_file(opts.model_config)
    try:
        model = ModelConfig.model_validate(recorded["model"])  # the EngineConfig's model section
    except (KeyError, TypeError) as e:
        raise ExportSourceError(
            f"checkpoint {info.uri}: its manifest's config has no `model` section ({e}); "
            "give --model-config job.yaml"
        ) from None
    except ValidationError as e:
        raise ExportSourceError(
            f"checkpoint {info.uri}: its manifest's model config is not valid here:\n"
            f"{format_validation_error(e, 'model')}\ngive --model-config job.yaml"
        ) from None
    check_given_model(model, opts, f"the manifest of {info.uri}")
    return model


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model (our naming) and its full shape; on the meta device, so nothing is allocated."""
    model = build_model(cfg, device="meta")
    return {canonical_name(k): tuple(v.shape) for k, v in model.state_dict().items()}


def load_model_state(mgr: CheckpointManager, info: CheckpointInfo, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full model tensors (our naming) of checkpoint `info`, read from whatever layout saved them."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    assert info.manifest is not None
    reader = ObjectStoreReader(mgr.store, info.prefix, info.manifest)
    try:
        metadata = reader.read_metadata()  # checksum-verified against the manifest
    except (ChecksumMismatch, ObjectMissing) as e:
        raise CorruptCheckpoint(f"{info.uri}: {e}") from None
    prefix = MODEL_KEY + "."
    stored: dict[str, Any] = {
        fqn[len(prefix) :]: md
        for fqn, md in metadata.state_dict_metadata.items()
        if fqn.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }
    by_name = {canonical_name(k): k for k in stored}
    expected = expected_shapes(cfg)
    # A tied head may be stored under its own name or not at all: the embedding is the head.
    optional = {"output.weight"} if cfg.tie_embeddings else set()
    problems = [f"{n}: missing from the checkpoint" for n in sorted(expected.keys() - by_name.keys() - optional)]
    problems += [f"{n}: in the checkpoint but not in the model" for n in sorted(by_name.keys() - expected.keys())]
    problems += [
        f"{n}: checkpoint shape {tuple(stored[k].size)} != model shape {expected[n]}"
        for n, k in sorted(by_name.items())
        if n in expected and tuple(stored[k].size) != expected[n]
    ]
    if problems:
        raise ExportSourceError(
            f"checkpoint {info.uri} does not fit the model config ({len(problems)} problems); if --model-config "
            "was given, it is not the model this checkpoint was trained with:\n  " + "\n  ".join(problems[:10])
        )
    # Plain CPU tensors of the full shapes: DCP reshards every saved shard into them. Only these
    # keys are read (the optimizer's entries stay in storage).
    target = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype) for k, md in stored.items()}
    state: dict[str, Any] = {MODEL_KEY: target}
    mgr.load(state, info)
    return {canonical_name(k): v for k, v in state[MODEL_KEY].items()}


def resolve_checkpoint(source: str, opts: ExportOptions) -> ExportSource | None:
    """The model of a persistent checkpoint, or None when `source` does not name checkpoints."""
    located = locate(source, opts)
    if located is None:
        return None
    root, named_step = located
    if named_step is not None and opts.step is not None and named_step != opts.step:
        raise ExportSourceError(
            f"{source!r} names step {named_step} but --step is {opts.step}; give one of them"
        )
    step = named_step if named_step is not None else opts.step
    s3 = S3Config(endpoint_url=opts.endpoint_url, region=opts.region)
    try:
        # Single process: world 1, no process group; it is closed below (its upload thread never runs).
        mgr = CheckpointManager(CheckpointConfig(s3=s3), root, rank=0, world_size=1)
    except (ValueError, StorageError) as e:
        raise ExportSourceError(f"cannot open {root}: {e}") from None
    notes: list[str] = []
    try:
        try:
            infos = mgr.list()
        except StorageError as e:
            raise ExportSourceError(f"cannot list checkpoints under {root}: {e}{_storage_hint(root)}") from None
        for info in _choose(infos, root, step):
            cfg = model_config_of(info, opts)
            try:
                state = load_model_state(mgr, info, cfg)
            except CorruptCheckpoint as e:
                if step is not None:
                    raise ExportSourceError(f"checkpoint {info.uri} is corrupt: {e}") from None
                notes.append(f"skipped step {info.step}: {e}")
                continue
            except StorageError as e:
                raise ExportSourceError(f"reading {info.uri} failed: {e}{_storage_hint(root)}") from None
            origin = f"checkpoint {info.uri} (step {info.step}, generation {info.generation})"
            recorded = info.manifest.config if info.manifest is not None else None
            return ExportSource(state, cfg, origin, tuple(notes), recorded_tokenizer(recorded))
        raise ExportSourceError(f"no loadable checkpoint under {root}: " + "; ".join(notes))
    finally:
        mgr.close()
