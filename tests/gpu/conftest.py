"""tests/gpu: the CUDA path (pinned/side-stream snapshots, NCCL abort and re-form, parity on a GPU).

Every test here is marked `gpu` and skipped where CUDA is absent: `pytest -m gpu tests/gpu` on a GPU
machine. Written against torch 2.11+ (NCCL error handling and `_abort_process_group`).
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs CUDA (tests/gpu runs with `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
