"""Submit-time checks of a job's data section: what can be known before any process starts.

`check_data(cfg)` returns one message per problem, each naming its field and the fix ([] when the
data looks usable). It opens what the job will open — the files, the tokenizer, a prepared
folder's metadata, the first rows of raw data — but tokenizes nothing, so it answers in well
under a second for any data set size. What only a full pass can find (a bad row in the middle of
a file, a data set shorter than one window after tokenization) is reported when the job starts.
"""

from __future__ import annotations

from pathlib import Path

from parallel.config import DataConfig, EngineConfig
from parallel.data.corpus import data_tokenizer, eval_config, is_prepared, read_meta
from parallel.data.encode import RAW_KINDS, read_rows
from parallel.data.readers import BadRows
from parallel.data.types import DataError


def _check_source(cfg: DataConfig, prefix: str, engine: EngineConfig) -> list[str]:
    try:
        return _source_problems(cfg, prefix, engine)
    except (OSError, ValueError) as e:  # a path the OS refuses (a NUL byte, too long, no permission)
        return [str(e) if isinstance(e, DataError) else f"{prefix}.path={cfg.path!r} cannot be read ({e}); "
                "point it at readable local data"]


def _source_problems(cfg: DataConfig, prefix: str, engine: EngineConfig) -> list[str]:
    vocab = engine.model.vocab_size
    seq_len = engine.training.seq_len
    if cfg.kind == "synthetic":
        return []
    assert cfg.path is not None
    if not Path(cfg.path).expanduser().exists():
        return [f"{prefix}.path={cfg.path!r} does not exist; point it at the data (a file or a folder)"]
    problems: list[str] = []
    try:
        tok = data_tokenizer(cfg, f"{prefix}.tokenizer")
    except DataError as e:
        return [str(e)]
    if tok.vocab_size > vocab:
        problems.append(
            f"{prefix}.tokenizer: {tok.name} has {tok.vocab_size} ids but model.vocab_size={vocab}; raise "
            f"model.vocab_size to at least {tok.vocab_size} or use a smaller tokenizer"
        )
    if cfg.format == "chat" and cfg.chat_template is None and tok.chat_template is None:
        problems.append(
            f"{prefix}.format=chat needs a chat template: {tok.name} has none (no chat_template in its "
            f"tokenizer_config.json); set {prefix}.chat_template or use a tokenizer that has one"
        )
    elif cfg.format == "chat":
        from parallel.data.formats import compile_template

        try:
            compile_template(cfg.chat_template or tok.chat_template or "")
        except DataError as e:
            problems.append(f"{prefix}.format=chat: {e}")
    try:
        if cfg.kind == "tokens":
            problems += _check_tokens(cfg, prefix, tok.fingerprint, seq_len)
        elif cfg.kind in RAW_KINDS and cfg.kind != "text":
            next(iter(read_rows(cfg, BadRows(cfg.on_bad_row, "data.on_bad_row: skip"), f"{prefix}.path")), None)
        elif cfg.kind == "text":
            next(iter(read_rows(cfg, BadRows(), f"{prefix}.path")), None)
    except DataError as e:
        problems.append(str(e))
    return problems


def _check_tokens(cfg: DataConfig, prefix: str, fingerprint: str, seq_len: int) -> list[str]:
    assert cfg.path is not None
    p = Path(cfg.path).expanduser()
    if not is_prepared(p):
        if p.is_dir():
            return [f"{prefix}.path={cfg.path!r} is a folder without meta.json: data.kind=tokens reads a folder "
                    "written by `unbroken data prepare` or a flat binary file of ids"]
        if cfg.document_mask:
            return [f"data.document_mask needs document boundaries, which the flat file {prefix}.path={cfg.path!r} "
                    "lacks; prepare the data with `unbroken data prepare` and point at that folder"]
        return []
    meta = read_meta(p, f"{prefix}.path")
    problems = []
    if int(meta["tokens"]) < seq_len + 1:
        problems.append(f"{prefix}.path={cfg.path!r} holds {meta['tokens']} tokens, fewer than "
                        f"training.seq_len+1={seq_len + 1}; use more data or a shorter seq_len")
    have = meta.get("tokenizer", {}).get("fingerprint")
    if cfg.tokenizer is not None and have is not None and have != fingerprint:
        problems.append(f"{prefix}.tokenizer={cfg.tokenizer!r} differs from the tokenizer {cfg.path!r} was prepared "
                        f"with; drop {prefix}.tokenizer (the folder carries its own) or prepare the data again")
    if "format" in cfg.model_fields_set and cfg.format != meta.get("data_format", "text"):
        problems.append(f"{prefix}.format={cfg.format} but {cfg.path!r} was prepared with format "
                        f"{meta.get('data_format')}; prepare it again with --format {cfg.format} or drop {prefix}.format")
    return problems


def check_data(cfg: EngineConfig) -> list[str]:
    """Problems with `cfg.data` (and its eval set) that would stop the job; [] when none."""
    problems = _check_source(cfg.data, "data", cfg)
    if cfg.training.eval_every is not None and cfg.data.eval is None:
        problems.append(f"training.eval_every={cfg.training.eval_every} but data.eval is not set; give data.eval "
                        "(a held-out set, or {split: 0.01} of the training data) or drop eval_every")
    if cfg.data.document_mask and cfg.parallelism.cp > 1 and cfg.parallelism.cp_impl == "builtin":
        problems.append("data.document_mask: parallelism.cp_impl=builtin (torch's context_parallel) cannot keep "
                        "attention inside documents; use cp_impl: ring")
    try:
        ecfg = eval_config(cfg.data)
    except DataError:
        ecfg = None  # the training data's tokenizer is broken: reported above
    if ecfg is not None:
        problems += _check_source(ecfg, "data.eval", cfg)
    return problems
