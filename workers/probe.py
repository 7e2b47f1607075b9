"""The start-up probe: what a job needs from a worker node, checked there before the gang starts.

The API cannot check these (it may run elsewhere, without the data or the credentials): the data
section passes parallel.data.check.check_data (paths, tokenizer, vocabulary, formats) and yields its
first batch, `model.init_from` exists, and the checkpoint root (and
`checkpoint.resume_from`) can be listed with the job's credentials, and the checkpoint root can be
written (a probe object, put and deleted). A problem found here is deterministic, so the job fails at
once with it instead of going through recoveries.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any


def probe_job(cfg: Any, ckpt_cfg: Any, default_root: str) -> list[str]:
    """Problems that would stop the job from starting, each naming its field and the fix; [] when none.

    `cfg` is the EngineConfig, `ckpt_cfg` the CheckpointConfig, `default_root` the checkpoint root
    used when `checkpoint.uri` is not set.
    """
    problems: list[str] = []
    problems += _probe_data(cfg)
    if cfg.model.init_from and not Path(cfg.model.init_from).expanduser().exists():
        problems.append(f"model.init_from={cfg.model.init_from!r} does not exist on the worker node; "
                        "point it at a folder written by export-hf or a Hugging Face checkpoint")
    problems += _probe_storage("checkpoint.uri", ckpt_cfg.uri or default_root, ckpt_cfg, writes=True)
    if ckpt_cfg.resume_from:
        problems += _probe_storage("checkpoint.resume_from", ckpt_cfg.resume_from, ckpt_cfg, must_hold=True)
    return problems


def _probe_data(cfg: Any) -> list[str]:
    from parallel.data import DataLoader
    from parallel.data.check import check_data

    quick = check_data(cfg)  # paths, tokenizer against model.vocab_size, formats: each with its fix
    if quick:
        return quick
    t = cfg.training
    try:
        loader = DataLoader(cfg.data, t.seq_len, t.global_batch_size, cfg.model.vocab_size)
        loader.global_batch(0)
    except Exception as e:  # noqa: BLE001 - any error here is the data's; reported with its message
        text = str(e) or type(e).__name__
        return [text if text.startswith("data.") else f"data: {text}"]
    return []


PROBE_KEY = ".unbroken-probe"  # put and deleted under the checkpoint root by the start-up check


def _probe_storage(field: str, uri: str, ckpt_cfg: Any, *, must_hold: bool = False,
                   writes: bool = False) -> list[str]:  # fmt: skip
    """`uri` can be listed (and, with `writes`, written): read-only credentials or a path that cannot
    be created would otherwise fail every persistent save of a running job, each logged, none fatal.
    The write also makes the store ready for the ranks' first checkpoint: a bucket's first writes, made
    by every rank at once, took SeaweedFS 1.1 s (volumes are allocated on the first write) against 0.08 s
    once one object had been written."""
    from checkpointing.uri import open_store

    doing = "read"
    try:
        store = open_store(uri, ckpt_cfg.s3)
        try:
            held = store.list("")
            if writes:
                doing = "written"
                key = f"{PROBE_KEY}-{socket.gethostname()}-{os.getpid()}"  # at the root: no folder is left
                store.put_bytes(key, b"unbroken start-up check\n")
                store.delete(key)
        finally:
            store.close()
    except Exception as e:  # noqa: BLE001 - credentials, endpoint, permissions: all said the same way
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        fix = ("check checkpoint.s3 (endpoint_url, access keys) or the worker's AWS_* environment"
               if uri.startswith("s3://") else "check the path and its permissions on the worker node")
        if doing == "written":
            fix = ("give the job's credentials write access there" if uri.startswith("s3://")
                   else "point it at a folder the worker can create and write")
        return [f"{field}={uri}: cannot be {doing} ({type(e).__name__}: {first}); {fix}"]
    if must_hold and not held:
        return [f"{field}={uri} holds no checkpoint; name a checkpoint root or a step-NNNNNNNN folder"]
    return []
