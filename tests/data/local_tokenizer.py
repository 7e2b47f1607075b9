"""A small BPE tokenizer trained here on local text (the Python standard library), never downloaded.

`make_tokenizer(folder)` writes a Hugging Face tokenizer folder: tokenizer.json (byte-level BPE with
<|endoftext|>, <|im_start|>, <|im_end|> as special tokens) and tokenizer_config.json naming the
EOS token and a ChatML chat template, so transformers' AutoTokenizer loads it too. It is built as
Qwen2's tokenizer is (NFC, Qwen's pre-tokenizer pattern, byte-level): transformers loads any
Qwen-family folder with its Qwen2Tokenizer class, which imposes those, so ids agree either way.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
STDLIB = Path(sysconfig.get_paths()["stdlib"])
CORPUS_FILES = ("json/decoder.py", "json/encoder.py", "textwrap.py", "string.py", "glob.py", "fnmatch.py")


def corpus_texts() -> list[str]:
    return [(STDLIB / f).read_text(encoding="utf-8") for f in CORPUS_FILES]


def make_tokenizer(folder: Path, vocab_size: int = 512, *, config: bool = True) -> Path:
    """Train (about a second) and save; returns the folder (or the bare tokenizer.json when config=False)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus_texts(), trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if not config:
        return folder / "tokenizer.json"
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "chat_template": CHATML,
    }), encoding="utf-8")
    return folder
