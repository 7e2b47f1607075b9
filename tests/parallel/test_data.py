"""The data pipeline: deterministic by (seed, step), dp-invariant slicing, sources and their errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from parallel.config import DataConfig
from parallel.data import IGNORE_INDEX, DataError, DataLoader


def loader(cfg: DataConfig | None = None, batch: int = 8, seq: int = 16, vocab: int = 256,
           micro: int | None = None) -> DataLoader:
    return DataLoader(cfg or DataConfig(), seq, batch, vocab, micro)


def real_rows(dl: DataLoader, step: int, dp: int) -> torch.Tensor:
    """Concatenate every dp rank's real (non-padding) rows in rank order."""
    rows = []
    for r in range(dp):
        for b in dl.micro_batches(step, r, dp):
            inputs, targets = b.inputs, b.targets
            keep = (targets != IGNORE_INDEX).all(dim=1)
            assert ((targets == IGNORE_INDEX).all(dim=1) | keep).all(), "a row is either real or padding"
            rows.append(torch.cat([inputs[keep], targets[keep][:, -1:]], dim=1))
    return torch.cat(rows)


def test_same_seed_and_step_same_batch_in_a_new_loader() -> None:
    a, b = loader().global_batch(5), loader().global_batch(5)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert not torch.equal(loader().global_batch(6).inputs, a.inputs)
    assert not torch.equal(loader(DataConfig(seed=1)).global_batch(5).inputs, a.inputs)


def test_targets_are_inputs_shifted() -> None:
    batch = loader().global_batch(0)
    inputs, targets = batch.inputs, batch.targets
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("micro", [None, 1, 2])
def test_dp_slices_cover_the_global_batch_in_order(dp: int, micro: int | None) -> None:
    dl = loader(micro=micro)
    batch = dl.global_batch(3)
    inputs, targets = batch.inputs, batch.targets
    expected = torch.cat([inputs, targets[:, -1:]], dim=1)
    assert torch.equal(real_rows(dl, 3, dp), expected)
    counts = {len(dl.micro_batches(3, r, dp)) for r in range(dp)}
    assert len(counts) == 1, "every rank runs the same number of micro-batches"


def test_padding_rows_weigh_nothing() -> None:
    dl = loader(batch=8)
    (batch,) = dl.micro_batches(0, 2, 3)  # share 3: rank 2 has rows 6, 7 and one pad
    targets = batch.targets
    assert targets.shape == (3, 16)
    assert (targets[2] == IGNORE_INDEX).all() and (targets[:2] != IGNORE_INDEX).all()


def test_text_folder_byte_level(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "a.txt").write_text("hello world " * 20)
    (tmp_path / "b" / "c.py").write_text("print('ünïcode')\n" * 20)
    (tmp_path / "blob.bin").write_bytes(bytes([0xFF, 0xFE, 0x00]) * 50)  # not UTF-8: skipped
    for hidden in ("__pycache__", ".git", "site-packages"):
        (tmp_path / hidden).mkdir()
        (tmp_path / hidden / "x.txt").write_text("~" * 300)  # caches and packages: skipped
    dl = loader(DataConfig(kind="text", path=str(tmp_path)), batch=4, seq=16)
    inputs = dl.global_batch(0).inputs
    # Each file is one document, followed by the byte-level end-of-document id 0.
    raw = (tmp_path / "a.txt").read_bytes() + b"\0" + (tmp_path / "b" / "c.py").read_bytes() + b"\0"
    assert 0xFE not in inputs.flatten().tolist() and ord("~") not in inputs.flatten().tolist()
    for row in inputs.tolist():  # every window is a real slice of the joined text
        assert bytes(row) in raw
    assert torch.equal(dl.global_batch(7).inputs, loader(DataConfig(kind="text", path=str(tmp_path)),
                                                         batch=4, seq=16).global_batch(7).inputs)


def test_windows_visit_every_window_once_per_epoch(tmp_path: Path) -> None:
    path = tmp_path / "ids.bin"
    np.arange(4 * 10 + 1, dtype=np.uint16).tofile(path)  # 10 windows of 4 (+1 for the last target)
    dl = loader(DataConfig(kind="tokens", path=str(path), token_dtype="uint16"), batch=5, seq=4, vocab=64)
    starts = sorted(int(dl.global_batch(s).inputs[j, 0]) for s in (0, 1) for j in range(5))
    assert starts == [4 * w for w in range(10)]


def test_tokens_errors(tmp_path: Path) -> None:
    path = tmp_path / "ids.bin"
    np.array([1, 2, 300, 4] * 20, dtype=np.int32).tofile(path)
    cfg = DataConfig(kind="tokens", path=str(path), token_dtype="int32")
    with pytest.raises(DataError, match="outside model.vocab_size=256"):
        loader(cfg, batch=2, seq=4).global_batch(0)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 7)
    with pytest.raises(DataError, match="not a multiple of 2 .uint16.; check data.token_dtype"):
        loader(DataConfig(kind="tokens", path=str(odd)))
    short = tmp_path / "short.bin"
    np.zeros(5, dtype=np.uint16).tofile(short)
    with pytest.raises(DataError, match="fewer than training.seq_len"):
        loader(DataConfig(kind="tokens", path=str(short)))


def test_text_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        loader(DataConfig(kind="text", path=str(tmp_path / "nope")))
    (tmp_path / "t.txt").write_text("x" * 100)
    with pytest.raises(DataError, match="needs model.vocab_size >= 256"):
        loader(DataConfig(kind="text", path=str(tmp_path / "t.txt")), vocab=128)


def test_resume_refuses_a_changed_data_order() -> None:
    state = loader().state_dict(step=4)
    loader().check_state(state)
    with pytest.raises(DataError, match="data seed=0 but this run has 3"):
        loader(DataConfig(seed=3)).check_state(state)
