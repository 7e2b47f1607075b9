"""Tokenizers: byte-level (the zero-dependency default) or a `tokenizers` JSON file / Hugging Face folder.

`load_tokenizer(path)` accepts a `tokenizer.json` or a folder holding one (a Hugging Face model or
tokenizer folder, whose `tokenizer_config.json` may name the EOS/BOS tokens and a chat template).
Nothing is downloaded: only local files are read. Every document ends with the tokenizer's EOS id,
so packed windows show the model where one document stops and the next begins.

Byte-level ids are the UTF-8 bytes 0..255; its end-of-document id is 0 (NUL), which text never
uses in practice, so a 256-token model holds it.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from parallel.data.types import DataError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# Files of a Hugging Face tokenizer folder that travel with a prepared data set and an export.
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG, "special_tokens_map.json", CHAT_TEMPLATE_FILE)
# End-of-document tokens of well-known tokenizers, tried in order when none is named.
KNOWN_EOS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")
BYTE_EOS_ID = 0


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id of the vocabulary."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dt).max + 1:
            return np.dtype(dt)
    raise DataError(f"a vocabulary of {vocab_size} ids does not fit 32-bit token ids")


class Tokenizer:
    """What the data pipeline needs of a tokenizer (byte-level here; `HFTokenizer` below)."""

    vocab_size = 256
    eos_id = BYTE_EOS_ID
    eos_token = "\x00"
    bos_token: str | None = None
    chat_template: str | None = None
    path: str | None = None  # the file or folder it was read from; None for byte-level
    fingerprint = "bytes"  # equal fingerprints encode equally

    @property
    def name(self) -> str:
        return "byte-level" if self.path is None else self.path

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def encode_documents(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Documents as one flat id array, each followed by the EOS id; and each document's length (EOS included)."""
        raw = [t.encode("utf-8") for t in texts]
        flat = np.frombuffer(b"\x00".join(raw) + b"\x00", dtype=np.uint8) if raw else np.zeros(0, np.uint8)
        return flat, np.fromiter((len(r) + 1 for r in raw), dtype=np.int64, count=len(raw))

    def encode_with_offsets(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and, for each, the [start, end) character span of `text` it came from."""
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        for i, ch in enumerate(text):
            raw = ch.encode("utf-8")
            ids.extend(raw)
            offsets.extend([(i, i + 1)] * len(raw))
        return ids, offsets

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if not (skip_special_tokens and i == BYTE_EOS_ID)).decode("utf-8", "replace")

    def token_id(self, token: str) -> int | None:
        raw = token.encode("utf-8")
        return raw[0] if len(raw) == 1 else None

    def files(self) -> dict[str, Path]:
        """The files that make up this tokenizer, by the name each has in a tokenizer folder."""
        return {}


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` read from a tokenizer.json, with the config of its folder if any."""

    def __init__(self, path: str, eos_token: str | None = None, field: str = "data.tokenizer") -> None:
        from tokenizers import Tokenizer as _Tok

        p = Path(path).expanduser()
        if not p.exists():
            raise DataError(f"{field}={path!r} does not exist; point it at a tokenizer.json or a folder holding one")
        folder = p if p.is_dir() else p.parent
        file = p / TOKENIZER_FILE if p.is_dir() else p
        if not file.is_file():
            raise DataError(
                f"{field}={path!r} has no {TOKENIZER_FILE}: only fast (tokenizers-library) tokenizers are read; "
                "save one with transformers' AutoTokenizer.from_pretrained(...).save_pretrained(folder)"
            )
        raw = file.read_bytes()
        try:
            self._tok = _Tok.from_str(raw.decode("utf-8"))
        except Exception as e:  # the library raises a bare Exception for malformed files
            raise DataError(f"{field}={path!r}: {file.name} is not a tokenizers JSON file ({e})") from None
        self.path = str(p.resolve())
        self._file = file.resolve()
        self._folder = folder if (p.is_dir() or (folder / TOKENIZER_CONFIG).is_file()) else None
        conf = self._config()
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(max(vocab.values(), default=-1) + 1, self._tok.get_vocab_size(with_added_tokens=True))
        self.eos_token, self.eos_id = self._find_eos(eos_token, conf, field)
        self.bos_token = _token_text(conf.get("bos_token"))
        self.chat_template = self._find_chat_template(conf)
        digest = hashlib.sha256(raw)
        digest.update(f"\0eos={self.eos_id}".encode())
        self.fingerprint = digest.hexdigest()[:16]

    def _config(self) -> dict[str, Any]:
        if self._folder is None or not (self._folder / TOKENIZER_CONFIG).is_file():
            return {}
        try:
            conf = json.loads((self._folder / TOKENIZER_CONFIG).read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{self._folder / TOKENIZER_CONFIG} is not valid JSON ({e})") from None
        return conf if isinstance(conf, dict) else {}

    def _find_eos(self, named: str | None, conf: dict[str, Any], field: str) -> tuple[str, int]:
        eos_field = field.rsplit(".", 1)[0] + ".eos_token"
        if named is not None:
            tid = self._tok.token_to_id(named)
            if tid is None:
                raise DataError(f"{eos_field}={named!r} is not a token of {self.path}; name one of its special tokens")
            return named, tid
        for candidate in (_token_text(conf.get("eos_token")), *KNOWN_EOS):
            if candidate and (tid := self._tok.token_to_id(candidate)) is not None:
                return candidate, tid
        special = [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special][:8]
        raise DataError(
            f"{field}={self.path!r} names no end-of-document token (no eos_token in {TOKENIZER_CONFIG} and none of "
            f"{list(KNOWN_EOS)}); set {eos_field} to one of its tokens" + (f", e.g. {special}" if special else "")
        )

    def _find_chat_template(self, conf: dict[str, Any]) -> str | None:
        template = conf.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None and self._folder is not None and (self._folder / CHAT_TEMPLATE_FILE).is_file():
            template = (self._folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
        return template if isinstance(template, str) else None

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        encs = self._tok.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        return [e.ids for e in encs]

    def encode_documents(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        ids = self.encode_batch(texts)
        lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
        eos = (self.eos_id,)
        flat = np.fromiter(itertools.chain.from_iterable(itertools.chain(x, eos) for x in ids),
                           dtype=dtype_for_vocab(self.vocab_size), count=int(lengths.sum()))
        return flat, lengths

    def encode_with_offsets(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
        return enc.ids, [tuple(o) for o in enc.offsets]  # type: ignore[misc]

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def files(self) -> dict[str, Path]:
        found = {TOKENIZER_FILE: self._file}
        if self._folder is not None:
            found.update({f: self._folder / f for f in TOKENIZER_FILES[1:] if (self._folder / f).is_file()})
        return found


def _token_text(value: Any) -> str | None:
    """A token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


BYTES = Tokenizer()


@functools.lru_cache(maxsize=8)
def _load(path: str, eos_token: str | None, field: str, mtime: float) -> HFTokenizer:
    return HFTokenizer(path, eos_token, field)


def load_tokenizer(path: str | None, eos_token: str | None = None, field: str = "data.tokenizer") -> Tokenizer:
    """The tokenizer at `path` (None: byte-level). Kept per process: a re-formed group rebuilds its
    Trainer, and reading a large tokenizer.json again would lengthen every recovery."""
    if path is None:
        if eos_token is not None and eos_token != BYTES.eos_token:
            raise DataError(
                f"{field.rsplit('.', 1)[0]}.eos_token={eos_token!r}: byte-level data ends documents with id 0; "
                f"set {field} to use another end token"
            )
        return BYTES
    p = Path(path).expanduser()
    try:
        mtime = (p / TOKENIZER_FILE if p.is_dir() else p).stat().st_mtime
    except (OSError, ValueError):  # missing, or a path the OS refuses: HFTokenizer says which
        mtime = 0.0
    return _load(str(p.resolve()) if p.exists() else path, eos_token, field, mtime)


def save_tokenizer(tok: Tokenizer, folder: str | Path) -> list[str]:
    """Write `tok`'s files into `folder` so that it loads again with the same ids and end token, here
    and with transformers' AutoTokenizer; returns the names written (none for byte-level)."""
    files = tok.files()
    if not files:
        return []
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    for name, src in files.items():
        if name != TOKENIZER_CONFIG:
            shutil.copyfile(src, out / name)
    conf: dict[str, Any] = {}
    if TOKENIZER_CONFIG in files:
        conf = json.loads(files[TOKENIZER_CONFIG].read_text(encoding="utf-8"))
    conf.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    conf["eos_token"] = tok.eos_token  # the end token the data was made with, even one named by data.eos_token
    if tok.chat_template is not None and "chat_template" not in conf and CHAT_TEMPLATE_FILE not in files:
        conf["chat_template"] = tok.chat_template
    (out / TOKENIZER_CONFIG).write_text(json.dumps(conf, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return sorted({*files, TOKENIZER_CONFIG})
