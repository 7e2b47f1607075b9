"""Checkpoint locations: `file:///abs/path`, a plain path, or `s3://bucket/prefix`.

`open_store` turns one into an ObjectStore. S3 credentials come from `S3Config` when it sets
them, else from boto3's standard chain; they are never part of a URI and never logged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from checkpointing.config import S3Config
from checkpointing.object_store import ObjectStore


@dataclass(frozen=True)
class CheckpointUri:
    scheme: str  # "file" or "s3"
    path: str = ""  # file: absolute path
    bucket: str = ""  # s3
    prefix: str = ""  # s3, no leading/trailing '/'

    def __str__(self) -> str:
        if self.scheme == "file":
            return f"file://{self.path}"
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def parse_uri(uri: str) -> CheckpointUri:
    """Parse a checkpoint location; a bare path means the local file system."""
    if not uri or not uri.strip():
        raise ValueError("checkpoint uri is empty; give file:///path or s3://bucket/prefix")
    if uri.startswith("s3://"):
        rest = uri[len("s3://") :]
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise ValueError(f"checkpoint uri {uri!r} has no bucket; write s3://bucket/prefix")
        if "@" in bucket or ":" in bucket:
            raise ValueError(
                f"checkpoint uri {uri!r}: put no credentials or endpoint in the uri; "
                "use checkpoint.s3 (endpoint_url, keys) or the AWS_* environment"
            )
        return CheckpointUri("s3", bucket=bucket, prefix=prefix.strip("/"))
    if uri.startswith("file://"):
        path = uri[len("file://") :]
        if not path.startswith("/"):
            raise ValueError(f"checkpoint uri {uri!r}: file:// needs an absolute path (file:///abs/path)")
        return CheckpointUri("file", path=os.path.normpath(path))
    if "://" in uri:
        raise ValueError(
            f"checkpoint uri {uri!r}: unsupported scheme; use file:///path or s3://bucket/prefix"
        )
    return CheckpointUri("file", path=os.path.abspath(uri))


def open_store(uri: str | CheckpointUri, s3: S3Config | None = None) -> ObjectStore:
    parsed = parse_uri(uri) if isinstance(uri, str) else uri
    if parsed.scheme == "file":
        from checkpointing.storage_file import FileStore

        return FileStore(parsed.path)
    from checkpointing.storage_s3 import S3Store

    return S3Store(parsed.bucket, parsed.prefix, s3)
