"""The manifest: what makes a persistent checkpoint exist.

Layout under a checkpoint root:
    step-00000100/__0_0.distcp ...   one DCP data object per rank
    step-00000100/.metadata          DCP's global metadata (written by the coordinator)
    step-00000100/manifest.json      written LAST, by rank 0, after every rank's objects are done
                                     (it also records the engine config the state was trained with)
    fences/gen-00000003.json         "generation 3 resumed from step N" (see catalog.py)

A step folder without a readable manifest is an incomplete checkpoint and is never loaded.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

MANIFEST_NAME = "manifest.json"
METADATA_NAME = ".metadata"
FORMAT = "unbroken-dcp/1"
_STEP_RE = re.compile(r"^step-(\d{8,})$")


class ManifestError(ValueError):
    """A manifest is unreadable or malformed; the message names the object and field."""


def step_dir(step: int) -> str:
    if step < 0:
        raise ValueError(f"step={step} must be >= 0")
    return f"step-{step:08d}"


def parse_step_dir(name: str) -> int | None:
    m = _STEP_RE.match(name.strip("/"))
    return int(m.group(1)) if m else None


def data_file_name(rank: int) -> str:
    return f"__{rank}_0.distcp"


@dataclass(frozen=True)
class FileEntry:
    name: str  # relative to the step folder
    size: int
    sha256: str


@dataclass
class Manifest:
    step: int
    generation: int
    world_size: int
    layout: dict[str, Any]
    files: list[FileEntry]
    created_at: float = field(default_factory=time.time)
    format: str = FORMAT
    # The EngineConfig (JSON data) the state was trained with, so the checkpoint alone can rebuild
    # the model (export-hf). Inside the manifest, so it appears atomically with the checkpoint.
    # None in checkpoints written before it was recorded.
    config: dict[str, Any] | None = None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> str:
        d = asdict(self)
        d["total_bytes"] = self.total_bytes
        return json.dumps(d, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> Manifest:
        try:
            d = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ManifestError(f"{where}: not valid JSON ({e}); the manifest is corrupt") from None
        if not isinstance(d, dict):
            raise ManifestError(f"{where}: expected a JSON object")
        if d.get("format") != FORMAT:
            raise ManifestError(
                f"{where}: format {d.get('format')!r} is not {FORMAT!r}; written by another tool?"
            )
        try:
            files = [FileEntry(str(f["name"]), int(f["size"]), str(f["sha256"])) for f in d["files"]]
            m = cls(
                step=int(d["step"]),
                generation=int(d["generation"]),
                world_size=int(d["world_size"]),
                layout=dict(d.get("layout") or {}),
                files=files,
                created_at=float(d["created_at"]),
                config=d.get("config"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"{where}: missing or bad field {e}; the manifest is corrupt") from None
        if m.config is not None and not isinstance(m.config, dict):
            raise ManifestError(f"{where}: config is a {type(m.config).__name__}, not an object; the manifest is corrupt")
        for f in files:
            if "/" in f.name or f.name in ("", ".", "..") or len(f.sha256) != 64:
                raise ManifestError(f"{where}: bad file entry {f.name!r}; the manifest is corrupt")
        return m


@dataclass(frozen=True)
class Fence:
    """Generation `generation` resumed from step `resume_step`: older generations' later steps are void."""

    generation: int
    resume_step: int
    created_at: float = field(default_factory=time.time)

    @staticmethod
    def key(generation: int) -> str:
        return f"fences/gen-{generation:08d}.json"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> Fence:
        try:
            d = json.loads(text)
            return cls(int(d["generation"]), int(d["resume_step"]), float(d.get("created_at", 0.0)))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"{where}: bad fence record ({e})") from None
