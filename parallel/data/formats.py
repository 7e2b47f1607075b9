"""Fine-tuning formats: records to token ids with a loss mask that keeps the loss on what the model should say.

- prompt_completion: fields `prompt` and `completion`; the document is the prompt's ids (with the
  tokenizer's own special tokens, e.g. BOS), the completion's ids and EOS; loss on the completion
  and the EOS.
- chat: a `messages` list of {role, content}, rendered with the chat template (data.chat_template,
  else the tokenizer's) as transformers' `apply_chat_template` renders it; loss on each assistant
  turn's content and the template's text after it in that turn (its end-of-turn marker), found by
  rendering the conversation turn by turn. The EOS that separates documents carries no loss.

Mask semantics (parallel.data.encode): 1 where the token is a target that carries loss.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from parallel.config import DataConfig
from parallel.data.readers import BadRows, Row
from parallel.data.tokenizer import Tokenizer, dtype_for_vocab
from parallel.data.types import DataError, Encoded


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> Any:
    """A Jinja chat template, compiled as transformers does (sandboxed, trim_blocks, lstrip_blocks)."""
    import json

    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                  ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise DataError(f"the chat template is not valid Jinja ({e}); fix data.chat_template (or the tokenizer's)") from None


def chat_template_of(cfg: DataConfig, tok: Tokenizer) -> str:
    template = cfg.chat_template or tok.chat_template
    if template is None:
        raise DataError(f"data.format=chat needs a chat template: {tok.name} has none; set data.chat_template "
                        "or use a tokenizer that has one")
    return template


def _check_messages(messages: list[Any]) -> str | None:
    """Why `messages` is not a conversation, or None."""
    if not messages:
        return "field 'messages' is empty"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"messages[{i}] is not {{role: str, content: str}}"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant turn: nothing to learn from"
    return None


def _render(template: Any, messages: list[dict[str, Any]], tok: Tokenizer) -> str:
    return template.render(messages=messages, add_generation_prompt=False, bos_token=tok.bos_token or "",
                           eos_token=tok.eos_token)


def chat_spans(template: Any, messages: list[dict[str, Any]], tok: Tokenizer) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character spans that carry loss."""
    full = _render(template, messages, tok)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(template, messages[:i], tok) if i else ""
        upto = _render(template, messages[: i + 1], tok)
        if not (full.startswith(upto) and upto.startswith(before)):
            raise ValueError("the chat template does not render turn by turn (a turn changes once more follow)")
        at = upto.find(m["content"], len(before)) if m["content"] else -1
        spans.append((at if at >= 0 else len(before), len(upto)))
    return full, spans


def encode_finetune(rows: list[Row], cfg: DataConfig, tok: Tokenizer, bad: BadRows) -> Encoded:
    docs: list[list[int]] = []
    masks: list[list[int]] = []
    if cfg.format == "prompt_completion":
        prompts = tok.encode_batch([r.values[0] for r in rows])
        completions = tok.encode_batch([r.values[1] for r in rows], add_special_tokens=False)
        for p, c in zip(prompts, completions, strict=True):
            docs.append([*p, *c, tok.eos_id])
            masks.append([0] * len(p) + [1] * (len(c) + 1))
    elif cfg.format == "chat":
        template = compile_template(chat_template_of(cfg, tok))
        for r in rows:
            messages = r.values[0]
            why = _check_messages(messages)
            if why is None:
                try:
                    text, spans = chat_spans(template, messages, tok)
                except Exception as e:  # a template's raise_exception, or one that cannot render this row
                    why = f"the chat template cannot render it ({type(e).__name__}: {e})"
            if why is not None:
                bad.add(r.where, why)
                continue
            ids, offsets = tok.encode_with_offsets(text, add_special_tokens=False)
            docs.append([*ids, tok.eos_id])
            masks.append([int(any(a <= s < b for a, b in spans)) for s, _ in offsets] + [0])
    else:
        raise DataError(f"data.format={cfg.format!r} is not a fine-tuning format")
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    flat = np.fromiter((t for d in docs for t in d), dtype=dtype_for_vocab(tok.vocab_size), count=int(lengths.sum()))
    mask = np.fromiter((m for ms in masks for m in ms), dtype=np.uint8, count=int(lengths.sum()))
    return Encoded(flat, lengths, mask)
