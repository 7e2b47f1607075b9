"""The examples run as a user runs them: `python -m examples.continue_qwen` (a short variant).

It trains a BPE tokenizer here, prepares a JSONL corpus, builds a Qwen2-shaped folder to continue, runs
the job with a held-out set through the SDK on `ray start` + `unbroken serve`, exports it with its
tokenizer and generates with transformers. `make demo` has its own test (tests/test_demo.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_continue_qwen_example(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    r = subprocess.run([sys.executable, "-m", "examples.continue_qwen", "--steps", "10", "--run-dir",
                        str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=840)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "SUCCEEDED" in out and "Qwen2ForCausalLM continues" in out, out[-4000:]
    assert (tmp_path / "run" / "hf" / "config.json").exists() and (tmp_path / "run" / "hf" / "tokenizer.json").exists()
