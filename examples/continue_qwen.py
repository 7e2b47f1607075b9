"""Continue a small Qwen-shaped model on a JSONL corpus, with a held-out evaluation, through the SDK.

Everything is built here, nothing is downloaded:

1. a byte-level BPE tokenizer trained with the `tokenizers` library on the Python standard library's
   source (Qwen2's pre-tokenizer, <|endoftext|> as EOS, a ChatML chat template);
2. a JSONL corpus of those sources (one document per top-level block; a held-out file of other modules);
3. `unbroken data prepare` tokenizes the corpus once into a prepared folder (ids, document index, tokenizer);
4. a small Qwen2 model (q/k/v biases, tied embeddings), randomly initialised and written as a
   `Qwen2ForCausalLM` folder with its tokenizer: the checkpoint the job continues (`model.init_from`);
5. a Ray cluster (`ray start`) and `unbroken serve` on this machine; the job (examples/continue_qwen.yaml)
   is submitted with the SDK and followed: train loss every step, eval loss every 10 steps;
6. `unbroken export-hf --tokenizer` writes the trained model; transformers loads it and generates.

    python -m examples.continue_qwen [--steps N] [--run-dir runs/continue_qwen]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import yaml

EXAMPLES = Path(__file__).resolve().parent
JOB_FILE = EXAMPLES / "continue_qwen.yaml"
MARKER = ".unbroken-continue-qwen"  # a run folder holding this file is the example's own, safe to clear
UNBROKEN = str(Path(sys.executable).with_name("unbroken"))
STDLIB = Path(sysconfig.get_paths()["stdlib"])
TRAIN_MODULES = ("json", "email", "http", "logging", "asyncio", "importlib", "unittest", "xml", "urllib")
HELDOUT_MODULES = ("concurrent", "wsgiref")
QWEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def say(text: str) -> None:
    print(text, flush=True)


def sources(modules: tuple[str, ...]) -> list[Path]:
    return sorted(f for m in modules for f in (STDLIB / m).rglob("*.py") if "test" not in f.parts)


def train_tokenizer(files: list[Path], out: Path, vocab_size: int) -> Path:
    """A Qwen2-style byte-level BPE, trained on `files` (transformers loads Qwen folders with Qwen2's
    tokenizer class, which imposes this pre-tokenizer, so ids agree after export)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((f.read_text(encoding="utf-8", errors="replace") for f in files), trainer=trainer)
    out.mkdir(parents=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "chat_template": CHATML,
    }), encoding="utf-8")
    return out


def write_jsonl(files: list[Path], out: Path) -> int:
    """One document per top-level block of each file (blocks split at blank-line-separated defs)."""
    n = 0
    with out.open("w", encoding="utf-8") as f:
        for src in files:
            text = src.read_text(encoding="utf-8", errors="replace")
            for block in text.split("\n\n\n"):
                if block.strip():
                    f.write(json.dumps({"text": block.strip() + "\n", "source": str(src.relative_to(STDLIB))}) + "\n")
                    n += 1
    return n


def build_base_model(job: dict[str, Any], tokenizer: Path, out: Path) -> None:
    """The checkpoint to continue: our Qwen2 model, seeded, written as a Qwen2ForCausalLM folder."""
    from parallel.config import ModelConfig
    from parallel.hf import export_hf
    from parallel.model import build_model, init_weights

    fields = {k: v for k, v in job["model"].items() if k != "init_from"}
    cfg = ModelConfig(**fields, init_seed=1234)
    model = build_model(cfg, device="cpu")
    init_weights(model, cfg)
    export_hf(model.state_dict(), cfg, str(out), tokenizer=str(tokenizer))


def follow(client: Any, job_id: str, total: int, timeout_s: float) -> Any:
    """Print every metrics row as it arrives (eval rows marked) until the job ends."""
    seen = 0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for row in client.metrics(job_id, after_step=seen):
            seen = max(seen, int(row["step"]))
            ev = f"   eval {row['eval_loss']:.4f} (ppl {row['eval_ppl']:.1f})" if "eval_loss" in row else ""
            say(f"  step {row['step']:>3}/{total}  loss {row['loss']:.4f}  {row['tokens_per_s']:>8,.0f} tok/s"
                f"  dp {row['dp']}{ev}")
        job = client.get(job_id)
        if job.terminal:
            return job
        time.sleep(1.0)
    raise TimeoutError(f"job {job_id} did not finish within {timeout_s:.0f}s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: the job file's)")
    ap.add_argument("--run-dir", type=Path, default=Path("runs/continue_qwen"))
    ap.add_argument("--timeout", type=float, default=1800.0)
    args = ap.parse_args(argv)
    run = args.run_dir.resolve()
    if run.exists():
        if not (run / MARKER).exists():
            raise SystemExit(f"{run} exists and is not this example's; choose another --run-dir")
        shutil.rmtree(run)
    run.mkdir(parents=True)
    (run / MARKER).touch()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    job = yaml.safe_load(JOB_FILE.read_text(encoding="utf-8"))

    say("1. a BPE tokenizer, trained here on the standard library's source")
    train_files, heldout_files = sources(TRAIN_MODULES), sources(HELDOUT_MODULES)
    tok = train_tokenizer(train_files, run / "tokenizer", job["model"]["vocab_size"])
    say(f"   {tok} ({job['model']['vocab_size']} ids, trained on {len(train_files)} files)")

    say("2. a JSONL corpus and a held-out set")
    n_train = write_jsonl(train_files, run / "train.jsonl")
    n_held = write_jsonl(heldout_files, run / "heldout.jsonl")
    say(f"   {n_train} training documents ({', '.join(TRAIN_MODULES)}), {n_held} held out ({', '.join(HELDOUT_MODULES)})")

    say("3. unbroken data prepare")
    cmd = [UNBROKEN, "data", "prepare", str(run / "train.jsonl"), str(run / "prepared"), "--tokenizer", str(tok)]
    say("   $ " + " ".join(cmd))
    subprocess.run(cmd, check=True)

    say("4. the checkpoint to continue: a small Qwen2 model, written as a Qwen2ForCausalLM folder")
    build_base_model(job, tok, run / "base")
    say(f"   {run / 'base'}")

    job["model"]["init_from"] = str(run / "base")
    job["data"]["path"] = str(run / "prepared")
    job["data"]["eval"]["path"] = str(run / "heldout.jsonl")
    job["training"]["output_dir"] = str(run / "job")
    if args.steps is not None:
        job["training"]["steps"] = args.steps
        job["training"]["warmup_steps"] = min(job["training"]["warmup_steps"], args.steps)

    say("5. a Ray cluster and unbroken serve; the job through the SDK")
    from examples.user_cluster import RayStartCluster, Serve

    with contextlib.ExitStack() as stack:
        cluster = RayStartCluster(head={"num-cpus": "2"})
        failed = False  # Ray's logs are kept when the job did not succeed
        stack.callback(lambda: cluster.stop(keep_logs=failed))
        serve = Serve(run / "home", address=cluster.address, env=cluster.env)
        stack.callback(serve.stop)
        serve.wait_ready()
        os.environ["UNBROKEN_HOME"] = str(run / "home")
        from unbroken import Client, JobSpec

        client = Client(serve.url, json.loads((run / "home" / "token").read_text())["token"])
        submitted = client.submit(JobSpec.model_validate(job))
        say(f"   submitted {submitted.id} to {serve.url}")
        done = follow(client, submitted.id, job["training"]["steps"], args.timeout)
        say(f"   {done.status}")
        if done.status != "SUCCEEDED":
            for ev in client.events(submitted.id, follow=False):
                say(f"   event {ev.kind}: {ev.message}")
            failed = True
            say(f"   Ray's logs are kept in {cluster.temp}/session_latest/logs")
            return 1

    say("6. unbroken export-hf with the tokenizer; transformers generates from it")
    cmd = [UNBROKEN, "export-hf", str(run / "job"), str(run / "hf"), "--tokenizer", str(run / "prepared" / "tokenizer")]
    say("   $ " + " ".join(cmd))
    subprocess.run(cmd, check=True)
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        say("   (install transformers to generate from the exported folder)")
        return 0
    hf_tok = AutoTokenizer.from_pretrained(str(run / "hf"))
    model = AutoModelForCausalLM.from_pretrained(str(run / "hf"), dtype=torch.float32)
    prompt = "def __init__(self"
    ids = hf_tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=40, do_sample=False)
    say(f"   {type(model).__name__} continues {prompt!r}:")
    say("   " + hf_tok.decode(out[0], skip_special_tokens=True).replace("\n", "\n   "))
    return 0


if __name__ == "__main__":
    sys.exit(main())
