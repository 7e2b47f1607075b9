"""The data pipeline: tokenizers, raw data readers, `prepare`, token corpora, windows and the loader.

Names are re-exported lazily (PEP 562), so `parallel.data.prepare` and the readers load without
torch: `unbroken data prepare` starts fast.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "IGNORE_INDEX": "parallel.data.types",
    "Batch": "parallel.data.types",
    "DataError": "parallel.data.types",
    "DataLoader": "parallel.data.loader",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'parallel.data' has no attribute {name!r}")
