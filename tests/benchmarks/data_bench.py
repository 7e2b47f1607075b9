"""The data pipeline's costs, each against a baseline measured in the same run.

1. `unbroken data prepare` throughput (tokens/s) over a plain `tokenizers` loop over the same JSONL
   files: read each line, json.loads it, encode_batch_fast 1024 texts at a time, count the ids —
   what anyone would write by hand. Target: ratio >= 0.8.
2. The loader's time per step (this rank's micro-batches of a step, with document masks, plus the
   step's loss-token count) over the train step of the debug preset on the same data. Target: < 2%.

    .venv/bin/python -m tests.benchmarks.data_bench
"""

from __future__ import annotations

import json
import shutil
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

STDLIB = Path(sysconfig.get_paths()["stdlib"])
QWEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
REPEATS = 3


def _corpus(folder: Path, copies: int = 2) -> tuple[list[Path], list[str]]:
    """JSONL files of the standard library's sources (one document per block), a few copies over."""
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in sorted(STDLIB.glob("*.py"))]
    docs = [b for t in texts for b in t.split("\n\n\n") if b.strip()]
    files = []
    for c in range(copies):
        path = folder / f"part{c}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
        files.append(path)
    return files, texts


def _tokenizer(folder: Path, texts: list[str]) -> Path:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts[:200], trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|endoftext|>"],
                                                             show_progress=False))
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def _plain_loop(files: list[Path], tokenizer_json: Path) -> tuple[int, float]:
    """The baseline: tokenizers by hand over the same files (tokens, seconds)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    t0 = time.perf_counter()
    n = 0
    for path in files:
        with path.open("rb") as f:
            batch: list[str] = []
            for line in f:
                batch.append(json.loads(line)["text"])
                if len(batch) == 1024:
                    n += sum(len(e.ids) for e in tok.encode_batch_fast(batch))
                    batch = []
            if batch:
                n += sum(len(e.ids) for e in tok.encode_batch_fast(batch))
    return n, time.perf_counter() - t0


def _prepare(folder: Path, tok_dir: Path, out: Path) -> tuple[int, float]:
    from parallel.config import DataConfig
    from parallel.data.prepare import prepare_dataset
    from parallel.data.tokenizer import load_tokenizer

    res = prepare_dataset(DataConfig(kind="jsonl", path=str(folder)), out, load_tokenizer(str(tok_dir)))
    return res.tokens - res.documents, res.seconds  # the EOS ids are ours, not the baseline's


def _loader_vs_step(folder: Path) -> tuple[float, float]:
    """(loader s/step, train step s) for the debug preset on byte-level prepared data with document masks."""
    import torch

    from parallel.config import DataConfig, EngineConfig
    from parallel.data.prepare import prepare_dataset
    from parallel.data.tokenizer import load_tokenizer
    from parallel.trainer import Trainer

    torch.set_num_threads(1)  # one rank's share of a small machine: a faster step, so a stricter fraction
    prepare_dataset(DataConfig(kind="jsonl", path=str(folder / "jsonl")), folder / "bytes", load_tokenizer(None))
    cfg = EngineConfig.model_validate({
        "model": {"preset": "debug"},
        "training": {"steps": 12, "seq_len": 128, "global_batch_size": 16},  # as examples/demo_job.yaml
        "data": {"kind": "tokens", "path": str(folder / "bytes"), "document_mask": True},
    })
    trainer = Trainer(cfg, device=torch.device("cpu"))
    steps = [trainer.train_step().step_time_s for _ in range(12)][2:]
    data = trainer.data
    loads = []
    for s in range(200):
        t0 = time.perf_counter()
        data.micro_batches(s, 0, 1)
        data.loss_tokens(s)
        loads.append(time.perf_counter() - t0)
    return statistics.median(loads), statistics.median(steps)


def main() -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="data-bench-"))
    try:
        (root / "jsonl").mkdir()
        files, texts = _corpus(root / "jsonl")
        tok_dir = _tokenizer(root / "tok", texts)
        mib = sum(f.stat().st_size for f in files) / 2**20
        plain, ours = [], []
        for r in range(REPEATS):  # alternated, best of each: the machine's load moves both alike
            plain.append(_plain_loop(files, tok_dir / "tokenizer.json"))
            ours.append(_prepare(root / "jsonl", tok_dir, root / f"out{r}"))
            shutil.rmtree(root / f"out{r}")
        assert {n for n, _ in plain} == {n for n, _ in ours}, "both count the same tokens"
        base_tps = max(n / s for n, s in plain)
        ours_tps = max(n / s for n, s in ours)
        ratio = ours_tps / base_tps
        print(f"prepare: {mib:.1f} MiB JSONL, {plain[0][0]:,} tokens; plain tokenizers loop {base_tps:,.0f} tok/s, "
              f"unbroken data prepare {ours_tps:,.0f} tok/s; ratio {ratio:.2f} (target >= 0.8)")
        load_s, step_s = _loader_vs_step(root)
        frac = load_s / step_s
        print(f"loader: {load_s * 1e3:.2f} ms per step (16 x 128 tokens, document masks); debug-preset step "
              f"{step_s * 1e3:.1f} ms; fraction {frac:.4f} (target < 0.02)")
        return {"prepare_tokens_per_s": ours_tps, "plain_tokens_per_s": base_tps, "prepare_ratio": ratio,
                "loader_s": load_s, "step_s": step_s, "loader_fraction": frac}
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
