"""The local demo (`python -m examples.local_demo`): a small Llama on the stdlib's source, no service.

The launcher path of an earlier stage, kept beside the service demo (`make demo`, examples/demo.py).
Two processes with FSDP, started by our own launcher (no Ray, no torchrun). Prints the loss
curve as a text chart, where metrics.jsonl and the final weights are, and a sample of what
the model writes after a minute of training.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import sysconfig
import time
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent
JOB_FILE = EXAMPLES / "local_demo.yaml"


def prepare_corpus(dest: Path) -> tuple[int, int]:
    """Copy the stdlib's top-level modules (real Python text every machine has): (files, bytes)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    files = sorted(stdlib.glob("*.py"))
    for f in files:
        shutil.copyfile(f, dest / f.name)
    return len(files), sum(f.stat().st_size for f in files)


def text_chart(values: list[float], height: int = 10, width: int = 60) -> str:
    """A compact chart: one column per bucket of steps (mean), a `*` at its height."""
    if not values:
        return "(no steps)"
    n = len(values)
    cols = min(width, n)
    buckets = [values[i * n // cols : (i + 1) * n // cols] for i in range(cols)]
    means = [sum(b) / len(b) for b in buckets]
    lo, hi = min(means), max(means)
    span = (hi - lo) or 1.0
    rows = []
    for r in range(height - 1, -1, -1):
        level = lo + span * r / (height - 1)
        cells = "".join("*" if round((m - lo) / span * (height - 1)) == r else " " for m in means)
        rows.append(f"{level:7.3f} |{cells}")
    rows.append(" " * 8 + "+" + "-" * cols)
    rows.append(" " * 9 + f"step 1{' ' * max(1, cols - 6 - len(str(n)))}{n}")
    return "\n".join(rows)


def sample_text(final_dir: Path, prompt: str, n_bytes: int = 120, seed: int = 0) -> str:
    """Let the trained model continue `prompt` (temperature 0.7, byte by byte)."""
    import torch

    torch.set_num_threads(1)  # tiny matmuls: more threads only fight the other processes

    from parallel.model import build_model
    from workers.final_state import load_final_state

    state, cfg = load_final_state(final_dir)
    model = build_model(cfg.model, device="cpu")
    model.load_state_dict(state)
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt.encode("utf-8"))
    window = min(64, cfg.training.seq_len)
    with torch.no_grad():
        for _ in range(n_bytes):
            logits = model(torch.tensor([ids[-window:]]))[0, -1]
            probs = torch.softmax(logits / 0.7, dim=-1)
            ids.append(int(torch.multinomial(probs, 1, generator=gen)))
    return bytes(ids).decode("utf-8", errors="replace")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="override training.steps")
    parser.add_argument("--output", default="runs/local-demo")
    args = parser.parse_args(argv)

    from parallel.config import EngineConfig
    from service.spec import SpecError, load_spec_file
    from workers.launcher import LaunchConfigError, RankFailure, run_local
    from workers.metrics_log import read_metrics

    out = Path(args.output).resolve()
    corpus = out / "corpus"
    n_files, n_bytes = prepare_corpus(corpus)
    print(f"corpus: {n_files} stdlib modules, {n_bytes / 1e6:.1f} MB of Python source (byte-level tokens)")
    try:
        cfg = load_spec_file(JOB_FILE, cls=EngineConfig)
        cfg.data.path = str(corpus)
        if args.steps is not None:
            cfg.training.warmup_steps = min(cfg.training.warmup_steps, args.steps)  # first: checked on assignment
            cfg.training.steps = args.steps
        print(
            f"job: {JOB_FILE.name}: model {cfg.model.preset} ({cfg.model.dim} dim, {cfg.model.n_layers} layers), "
            f"{cfg.training.steps} steps of {cfg.training.global_batch_size}x{cfg.training.seq_len} tokens, "
            f"{args.nproc} processes (FSDP)"
        )
        t0 = time.perf_counter()
        result = run_local(cfg, args.nproc, out, device="auto")
    except (SpecError, LaunchConfigError) as e:
        print(f"error: the demo job was refused:\n{e}", file=sys.stderr)
        return 2
    except RankFailure as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    lines = read_metrics(result.metrics_path)
    losses = [line["loss"] for line in lines]
    steady = [line["tokens_per_s"] for line in lines[len(lines) // 2 :]]
    print()
    print("loss (mean per bucket of steps):")
    print(text_chart(losses))
    print()
    print(
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps "
        f"(uniform guessing over bytes is ln 256 = 5.545)"
    )
    print(
        f"{sum(steady) / len(steady):,.0f} tokens/s (2nd half, all ranks), start-up {result.setup_s or 0:.1f}s, "
        f"wall {time.perf_counter() - t0:.1f}s"
    )
    print(f"metrics:       {result.metrics_path}")
    print(f"final weights: {result.final_dir}  (unbroken export-hf {out} OUT_DIR -> a Hugging Face folder)")
    if result.final_dir is not None:
        prompt = "def "
        print(f"\nthe model continues {prompt!r}:\n---\n{sample_text(result.final_dir, prompt)}\n---")
    return 0


if __name__ == "__main__":
    sys.exit(main())
