"""Which files of a data folder a job reads, and what tells a process its data changed.

Hidden entries, cache folders and installed packages (SKIP_DIRS) are left out and not walked into;
links to folders are not followed, links to files are read; the order is by path, the same everywhere.
The stamp that keys a process's tokenized copy covers exactly the files read: a change to one of them
is seen, a change elsewhere in the folder is not.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from parallel.config import DataConfig
from parallel.data import DataError
from parallel.data.corpus import _stamp, open_corpus
from parallel.data.readers import list_files


def _tree(root: Path) -> None:
    for rel in ("b.txt", "a/x.txt", "a/b/y.json", "A/z.txt", "a b/é.txt", "a-b/w.txt", ".hidden.txt",
                "a/.git/config", "a/__pycache__/m.txt", "lib/site-packages/pkg/p.txt", "node_modules/n.txt",
                "d.jsonl"):
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(f"text of {rel}\n", encoding="utf-8")
    os.symlink(root / "a", root / "linked_dir")
    os.symlink(root / "b.txt", root / "linked_file.txt")
    os.symlink(root / "missing", root / "broken.txt")


def test_listed_files_skip_hidden_cache_and_package_folders(tmp_path: Path) -> None:
    _tree(tmp_path)
    got = [str(f.relative_to(tmp_path)) for f in list_files(str(tmp_path), None)]
    assert got == ["A/z.txt", "a/b/y.json", "a/x.txt", "a b/é.txt", "a-b/w.txt", "b.txt", "d.jsonl",
                   "linked_file.txt"]
    assert [f.name for f in list_files(str(tmp_path), (".jsonl", ".json"))] == ["y.json", "d.jsonl"]
    assert list_files(str(tmp_path / "b.txt"), None) == [tmp_path / "b.txt"]
    with pytest.raises(DataError, match=r"data.path=.* holds no data files \(\*.parquet\)"):
        list_files(str(tmp_path), (".parquet",))
    with pytest.raises(DataError, match="does not exist"):
        list_files(str(tmp_path / "nope"), None)


def test_stamp_covers_exactly_the_files_read(tmp_path: Path) -> None:
    _tree(tmp_path)

    def stamp() -> list[list]:
        _stamp.cache_clear()  # a process keeps its stamp for its run; a new one sees the change
        return json.loads(_stamp(str(tmp_path), "text", "train"))

    before = stamp()
    assert [Path(name).relative_to(tmp_path).as_posix() for name, _, _ in before] == [
        str(f.relative_to(tmp_path)) for f in list_files(str(tmp_path), None)]
    (tmp_path / "lib/site-packages/pkg/p.txt").write_text("changed, but never read\n")
    (tmp_path / "a/__pycache__/m.txt").write_text("changed, but never read\n")
    assert stamp() == before
    (tmp_path / "a/x.txt").write_text("a longer text than before\n")
    assert stamp() != before


def test_a_changed_file_is_tokenized_again(tmp_path: Path) -> None:
    (tmp_path / "one.txt").write_text("abc\n", encoding="utf-8")
    cfg = DataConfig.model_validate({"kind": "text", "path": str(tmp_path)})
    first = open_corpus(cfg).n_tokens
    (tmp_path / "two.txt").write_text("defgh\n", encoding="utf-8")
    _stamp.cache_clear()  # a process keeps its stamp for its run; a new one sees the change
    assert open_corpus(cfg).n_tokens > first
