"""Reading documents (records) from local files: text, JSONL, Parquet and `datasets` save_to_disk folders.

Each reader yields batches of `Row`s in a fixed order (files sorted by path, rows in file order), so
the token stream built from them is the same on every machine. A row that cannot be used (not
UTF-8, not JSON, a missing or mistyped field) goes to `BadRows` with its file and line (or row
number): `on_bad_row: fail` refuses the data set at once, `skip` drops the row and counts it.

`hf_dataset` folders are read with pyarrow alone: `save_to_disk` writes Arrow IPC stream files
listed in `state.json` (a DatasetDict adds `dataset_dict.json` and one sub-folder per split), so
the `datasets` package is not needed to read them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parallel.data.types import DataError

# Folders under a data folder that hold caches or installed packages, not the data meant.
SKIP_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages", "node_modules"})
SUFFIXES: dict[str, tuple[str, ...]] = {"jsonl": (".jsonl", ".json"), "parquet": (".parquet",)}
BATCH_ROWS = 1024


@dataclass
class Row:
    where: str  # "file:line" or "file: row N", for messages
    values: tuple[Any, ...]  # the requested fields, in order


@dataclass
class BadRows:
    """Rows that could not be used: refused at the first (`fail`) or counted and skipped (`skip`)."""

    policy: str = "fail"
    skip_hint: str = "data.on_bad_row: skip"  # how the user asks to skip, for the message
    count: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, where: str, reason: str) -> None:
        if self.policy == "fail":
            raise DataError(f"bad row at {where}: {reason}; fix the row, or skip such rows with {self.skip_hint}")
        self.count += 1
        if len(self.examples) < 5:
            self.examples.append(f"{where}: {reason}")


def _walk(root: str, rel: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], str]]:
    """(path parts under the root, path) of every file below `root`, hidden and SKIP_DIRS folders pruned,
    not walked: a data folder such as a Python install holds tens of thousands of files in site-packages
    that a walk-then-filter stats for nothing (seconds per process). Links to folders are not followed."""
    try:
        with os.scandir(root) as it:
            entries = list(it)
    except PermissionError:
        return
    for e in entries:
        if e.name.startswith("."):
            continue
        if e.is_dir(follow_symlinks=False):
            if e.name not in SKIP_DIRS:
                yield from _walk(e.path, (*rel, e.name))
        elif e.is_file():
            yield (*rel, e.name), e.path


def list_files(path: str, suffixes: tuple[str, ...] | None, what: str = "data.path") -> list[Path]:
    """`path` itself if it is a file, else the files under it (sorted; hidden and cache folders skipped),
    keeping those ending in one of `suffixes` (all when None)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"{what}={path!r} does not exist; point it at a file or a folder of them")
    if p.is_file():
        return [p]
    files = [Path(f) for parts, f in sorted(_walk(str(p))) if suffixes is None or parts[-1].endswith(suffixes)]
    if not files:
        kinds = f" ({', '.join('*' + s for s in suffixes)})" if suffixes else ""
        raise DataError(f"{what}={path!r} holds no data files{kinds}; point it at a folder that does")
    return files


def _check_value(name: str, value: Any, where: str, bad: BadRows, want: type) -> bool:
    if value is None:
        bad.add(where, f"missing field {name!r}")
        return False
    if not isinstance(value, want):
        bad.add(where, f"field {name!r} is {type(value).__name__}, not {'a string' if want is str else 'a list'}")
        return False
    return True


def _pick(record: Any, fields: tuple[str, ...], kinds: tuple[type, ...], where: str, bad: BadRows) -> Row | None:
    if not isinstance(record, dict):
        bad.add(where, f"a row is a JSON object, got {type(record).__name__}")
        return None
    values = tuple(record.get(f) for f in fields)
    for f, v, k in zip(fields, values, kinds, strict=True):
        if not _check_value(f, v, where, bad, k):
            return None
    return Row(where, values)


def read_text(path: str, what: str = "data.path") -> Iterator[list[Row]]:
    """Each UTF-8 file one document; files that are not UTF-8 (binaries) and empty ones are passed over."""
    batch: list[Row] = []
    for f in list_files(path, None, what):
        try:
            text = f.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # not text
        if text:
            batch.append(Row(str(f), (text,)))
        if len(batch) >= 64:
            yield batch
            batch = []
    if batch:
        yield batch


def read_jsonl(path: str, fields: tuple[str, ...], kinds: tuple[type, ...], bad: BadRows,
               what: str = "data.path") -> Iterator[list[Row]]:
    batch: list[Row] = []
    for f in list_files(path, SUFFIXES["jsonl"], what):
        with f.open("rb") as fh:
            for n, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                where = f"{f}:{n}"
                try:
                    record = json.loads(line)  # bytes: decoded as UTF-8, refused when they are not
                except UnicodeDecodeError:
                    bad.add(where, "not UTF-8")
                    continue
                except json.JSONDecodeError as e:
                    bad.add(where, f"not JSON ({e.msg} at column {e.colno})")
                    continue
                row = _pick(record, fields, kinds, where, bad)
                if row is not None:
                    batch.append(row)
                    if len(batch) >= BATCH_ROWS:
                        yield batch
                        batch = []
    if batch:
        yield batch


def _arrow_rows(batches: Iterator[Any], name: str, fields: tuple[str, ...], kinds: tuple[type, ...],
                bad: BadRows, columns_hint: str) -> Iterator[list[Row]]:
    n = 0
    for rb in batches:
        have = set(rb.schema.names)
        missing = [f for f in fields if f not in have]
        if missing:
            raise DataError(
                f"{name} has no column {missing[0]!r} (columns: {', '.join(rb.schema.names)}); {columns_hint}"
            )
        cols = [rb.column(f).to_pylist() for f in fields]
        out: list[Row] = []
        for i, values in enumerate(zip(*cols, strict=True)):
            where = f"{name}: row {n + i + 1}"
            if all(_check_value(f, v, where, bad, k) for f, v, k in zip(fields, values, kinds, strict=True)):
                out.append(Row(where, tuple(values)))
        n += rb.num_rows
        if out:
            yield out


def read_parquet(path: str, fields: tuple[str, ...], kinds: tuple[type, ...], bad: BadRows, hint: str,
                 what: str = "data.path") -> Iterator[list[Row]]:
    import pyarrow.parquet as pq

    for f in list_files(path, SUFFIXES["parquet"], what):
        try:
            pf = pq.ParquetFile(f)
        except Exception as e:  # pyarrow raises ArrowInvalid/OSError for files that are not Parquet
            raise DataError(f"{f} is not a Parquet file ({e}); remove it from {what} or fix it") from None
        have = pf.schema_arrow.names
        missing = [c for c in fields if c not in have]
        if missing:
            raise DataError(f"{f} has no column {missing[0]!r} (columns: {', '.join(have)}); {hint}")
        yield from _arrow_rows(pf.iter_batches(batch_size=BATCH_ROWS, columns=list(fields)), str(f), fields, kinds,
                               bad, hint)


def hf_dataset_files(path: str, split: str, what: str = "data.path", split_field: str = "data.hf_split") -> list[Path]:
    """The Arrow files of a save_to_disk folder (a Dataset, or split `split` of a DatasetDict), in order."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise DataError(f"{what}={path!r} is not a folder; data.kind=hf_dataset reads a datasets save_to_disk folder")
    if (p / "dataset_dict.json").is_file():
        try:
            splits = json.loads((p / "dataset_dict.json").read_text(encoding="utf-8")).get("splits", [])
        except (json.JSONDecodeError, AttributeError):
            splits = []
        if split not in splits:
            raise DataError(f"{what}={path!r} is a DatasetDict without split {split!r} (splits: {splits}); "
                            f"set {split_field} to one of them")
        p = p / split
    state = p / "state.json"
    if not state.is_file():
        raise DataError(
            f"{what}={str(p)!r} has no state.json: it is not a folder written by datasets' save_to_disk "
            "(for JSONL or Parquet files use kind jsonl or parquet)"
        )
    try:
        names = [d["filename"] for d in json.loads(state.read_text(encoding="utf-8"))["_data_files"]]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DataError(f"{state} does not list its data files ({e}); write the folder again with save_to_disk") from None
    files = [p / n for n in names]
    for f in files:
        if not f.is_file():
            raise DataError(f"{f} is listed in {state} but missing; the folder is incomplete")
    return files


def read_hf_dataset(path: str, split: str, fields: tuple[str, ...], kinds: tuple[type, ...], bad: BadRows,
                    hint: str, what: str = "data.path") -> Iterator[list[Row]]:
    import pyarrow as pa

    for f in hf_dataset_files(path, split, what):
        try:
            reader = pa.ipc.open_stream(pa.memory_map(str(f)))
        except pa.ArrowInvalid as e:
            raise DataError(f"{f} is not an Arrow stream file ({e}); write the folder again with save_to_disk") from None
        yield from _arrow_rows(iter(reader), str(f), fields, kinds, bad, hint)
