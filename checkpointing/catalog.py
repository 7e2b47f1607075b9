"""Finding, listing and verifying persistent checkpoints. No torch: the CLI uses this directly.

A checkpoint is valid when
  1. its manifest exists and parses (else "incomplete: no manifest"),
  2. every file the manifest lists exists with the listed size (cheap check) and, when checked
     deeply, hashes to the listed SHA-256 (else "checksum mismatch: ..."),
  3. it is not fenced. Generations fence older ones' futures: when generation G resumed from step S
     (a fence record, written by `write_fence`), any checkpoint of a generation < G with a step > S
     belongs to an abandoned timeline (a zombie of G-1 may still write one). The same follows from
     the manifests alone: a checkpoint (g, s) is fenced by any checkpoint (g' > g, s' <= s).
     So generations must only grow for a given root, across job restarts too (`max_generation`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from checkpointing.manifest import (
    MANIFEST_NAME,
    Fence,
    Manifest,
    ManifestError,
    parse_step_dir,
    step_dir,
)
from checkpointing.object_store import ChecksumMismatch, ObjectMissing, ObjectStore, StorageError


@dataclass
class CheckpointInfo:
    step: int
    root_uri: str
    manifest: Manifest | None
    valid: bool
    reason: str | None = None  # why not valid
    verified: bool = False  # True once every file's SHA-256 was checked

    @property
    def generation(self) -> int | None:
        return self.manifest.generation if self.manifest else None

    @property
    def world_size(self) -> int | None:
        return self.manifest.world_size if self.manifest else None

    @property
    def layout(self) -> dict[str, Any]:
        return self.manifest.layout if self.manifest else {}

    @property
    def total_bytes(self) -> int:
        return self.manifest.total_bytes if self.manifest else 0

    @property
    def prefix(self) -> str:
        return step_dir(self.step)

    @property
    def uri(self) -> str:
        return f"{self.root_uri.rstrip('/')}/{self.prefix}"


@dataclass
class VerifyReport:
    step: int
    ok: bool
    problems: list[str] = field(default_factory=list)
    files_checked: int = 0
    bytes_checked: int = 0


def read_fences(store: ObjectStore) -> list[Fence]:
    fences = []
    for key in store.list("fences/"):
        try:
            fences.append(Fence.from_json(store.get(key), store.describe(key)))
        except (ManifestError, ObjectMissing):
            continue  # a half-written fence is no fence
    return fences


def write_fence(store: ObjectStore, generation: int, resume_step: int) -> None:
    """Record that `generation` resumed from `resume_step` (call before it writes anything)."""
    store.put_bytes(Fence.key(generation), Fence(generation, resume_step).to_json().encode())


def _load_manifest(store: ObjectStore, step: int) -> tuple[Manifest | None, str | None]:
    key = f"{step_dir(step)}/{MANIFEST_NAME}"
    try:
        return Manifest.from_json(store.get(key), store.describe(key)), None
    except ObjectMissing:
        return None, "incomplete: no manifest"
    except ManifestError as e:
        return None, f"bad manifest: {e}"


def _fenced(m: Manifest, manifests: list[Manifest], fences: list[Fence]) -> str | None:
    for f in fences:
        if f.generation > m.generation and m.step > f.resume_step:
            return (
                f"fenced: generation {f.generation} resumed from step {f.resume_step}; this checkpoint of "
                f"generation {m.generation} is from an abandoned timeline"
            )
    for o in manifests:
        if o.generation > m.generation and o.step <= m.step and o is not m:
            return (
                f"fenced: generation {o.generation} wrote step {o.step} <= {m.step}; this checkpoint of "
                f"generation {m.generation} is from an abandoned timeline"
            )
    return None


def _check_sizes(store: ObjectStore, m: Manifest, listing: dict[str, int]) -> str | None:
    for f in m.files:
        key = f"{step_dir(m.step)}/{f.name}"
        if key not in listing:
            return f"incomplete: {store.describe(key)} is missing"
        if listing[key] != f.size:
            return (
                f"checksum mismatch: {store.describe(key)} has {listing[key]} bytes, "
                f"the manifest says {f.size}"
            )
    return None


def list_checkpoints(store: ObjectStore) -> list[CheckpointInfo]:
    """Every step folder under the root, oldest first, with a cheap validity check (no hashing)."""
    listing = store.list()
    steps = sorted({s for k in listing if (s := parse_step_dir(k.split("/", 1)[0])) is not None})
    loaded = {s: _load_manifest(store, s) for s in steps}
    manifests = [m for m, _ in loaded.values() if m is not None]
    fences = read_fences(store)
    out = []
    for s in steps:
        m, why = loaded[s]
        if m is not None and m.step != s:
            m, why = None, f"bad manifest: it says step {m.step} but lies in {step_dir(s)}"
        if m is not None:
            why = _check_sizes(store, m, listing) or _fenced(m, manifests, fences)
        out.append(CheckpointInfo(step=s, root_uri=store.root_uri, manifest=m, valid=why is None, reason=why))
    return out


def verify_files(store: ObjectStore, info: CheckpointInfo) -> VerifyReport:
    """Re-hash every file the manifest lists."""
    rep = VerifyReport(step=info.step, ok=True)
    if info.manifest is None:
        rep.ok = False
        rep.problems.append(info.reason or "incomplete: no manifest")
        return rep
    for f in info.manifest.files:
        key = f"{info.prefix}/{f.name}"
        try:
            store.get_verified(key, f.size, f.sha256)
            rep.files_checked += 1
            rep.bytes_checked += f.size
        except ChecksumMismatch as e:
            rep.problems.append(str(e))
        except ObjectMissing:
            rep.problems.append(f"{store.describe(key)} is missing")
        except StorageError as e:
            rep.problems.append(str(e))
    rep.ok = not rep.problems
    return rep


def verify_checkpoint(store: ObjectStore, step: int) -> VerifyReport:
    infos = {i.step: i for i in list_checkpoints(store)}
    if step not in infos:
        return VerifyReport(
            step=step, ok=False, problems=[f"no checkpoint {step_dir(step)} under {store.root_uri}"]
        )
    info = infos[step]
    rep = verify_files(store, info)
    if info.reason and info.reason.startswith("fenced"):
        rep.problems.append(info.reason)
        rep.ok = False
    return rep


def max_generation(store: ObjectStore) -> int | None:
    """The highest generation any manifest or fence under the root carries (None if none).

    Generations must grow across runs that share a root (a resumed job starts above this),
    otherwise the new run's checkpoints would be fenced by the old run's.
    """
    gens = [i.generation for i in list_checkpoints(store) if i.generation is not None]
    gens += [f.generation for f in read_fences(store)]
    return max(gens) if gens else None


def find_latest_valid(
    store: ObjectStore, *, deep: bool = True
) -> tuple[CheckpointInfo | None, list[tuple[int, str]]]:
    """The newest valid checkpoint and, for each newer one skipped, (step, reason).

    deep=True re-hashes every file of a candidate before accepting it (reads it all once).
    """
    skipped: list[tuple[int, str]] = []
    for info in reversed(list_checkpoints(store)):
        if not info.valid:
            skipped.append((info.step, info.reason or "invalid"))
            continue
        if deep:
            rep = verify_files(store, info)
            if not rep.ok:
                skipped.append((info.step, "; ".join(rep.problems)))
                continue
            info.verified = True
        return info, skipped
    return None, skipped
