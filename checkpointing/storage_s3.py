"""The persistent tier on S3 (or any S3-compatible server: SeaweedFS, MinIO, R2, ...).

Uploads are parallel multipart (`S3Config.part_size_mb` parts, `max_concurrency` at a time)
through s3transfer, with botocore's standard retry mode and exponential backoff. The SHA-256 of
each object is computed while its bytes stream out and is recorded in the manifest; reads check it.
An S3 object appears only when its (multipart) upload completes, so writes are atomic.

Credentials come from `S3Config` (access key and secret) or boto3's standard chain (env vars,
~/.aws, instance roles). They are never logged and never put into an error message.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Iterable
from typing import Any

from checkpointing.config import S3Config
from checkpointing.object_store import (
    Chunk,
    HashingReader,
    ObjectMissing,
    ObjectStore,
    PutResult,
    StorageError,
)

_MiB = 1024 * 1024

# One client per process and settings: a boto3 client is thread-safe, and a new one costs 50-100 ms of
# CPU (a fresh session loads botocore's models), which every re-form of a job's group would pay again.
_clients: dict[tuple[Any, ...], Any] = {}
_clients_lock = threading.Lock()


def _client(kwargs: dict[str, Any], bc: Any, cfg: S3Config) -> Any:
    import boto3

    key = (tuple(sorted(kwargs.items())), cfg.max_attempts, cfg.read_timeout_s, cfg.max_concurrency)
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = boto3.session.Session().client("s3", config=bc, **kwargs)
        return client


class S3Store(ObjectStore):
    def __init__(self, bucket: str, prefix: str, cfg: S3Config | None = None, *, client: Any = None) -> None:
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        cfg = cfg or S3Config()
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.root_uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.endpoint_url = cfg.endpoint_url
        self._secrets = [
            s.get_secret_value() for s in (cfg.access_key_id, cfg.secret_access_key) if s is not None
        ]
        if client is None:
            bc = Config(
                retries={"max_attempts": cfg.max_attempts, "mode": "standard"},
                read_timeout=cfg.read_timeout_s,
                connect_timeout=min(10.0, cfg.read_timeout_s),
                max_pool_connections=max(10, 2 * cfg.max_concurrency),
                s3={"addressing_style": "path"} if cfg.endpoint_url else None,
            )
            kwargs: dict[str, Any] = {}
            if cfg.endpoint_url:
                kwargs["endpoint_url"] = cfg.endpoint_url
            if cfg.region:
                kwargs["region_name"] = cfg.region
            if cfg.access_key_id is not None and cfg.secret_access_key is not None:  # (both or neither: S3Config)
                kwargs["aws_access_key_id"] = cfg.access_key_id.get_secret_value()
                kwargs["aws_secret_access_key"] = cfg.secret_access_key.get_secret_value()
            client = _client(kwargs, bc, cfg)
        self.client = client
        part = cfg.part_size_mb * _MiB
        self.transfer = TransferConfig(
            multipart_threshold=part,
            multipart_chunksize=part,
            max_concurrency=cfg.max_concurrency,
            use_threads=cfg.max_concurrency > 1,
        )

    def __repr__(self) -> str:  # no credentials, ever
        return f"S3Store({self.root_uri!r}, endpoint={self.endpoint_url!r})"

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _scrub(self, text: str) -> str:
        for s in self._secrets:
            if s:
                text = text.replace(s, "***")
        return text

    def _error(self, op: str, key: str, e: Exception) -> StorageError:
        from botocore.exceptions import ClientError, EndpointConnectionError

        where = self.describe(key) if key else self.root_uri
        if isinstance(e, ClientError):
            code = e.response.get("Error", {}).get("Code", "?")
            msg = e.response.get("Error", {}).get("Message", "")
            fix = {
                "NoSuchBucket": f"bucket {self.bucket!r} does not exist; create it or fix checkpoint.uri",
                "InvalidAccessKeyId": "the access key is unknown to the server; check checkpoint.s3 or AWS_* env",
                "SignatureDoesNotMatch": "the secret key is wrong; check checkpoint.s3 or AWS_* env",
                "AccessDenied": "the credentials may not access this bucket/prefix",
            }.get(code, "check the endpoint, bucket and credentials")
            text = f"S3 {op} of {where} failed: {code} {msg}; {fix}"
        elif isinstance(e, EndpointConnectionError):
            text = f"S3 {op} of {where} failed: cannot reach endpoint {self.endpoint_url or '(AWS default)'}; is the server up?"
        else:
            text = f"S3 {op} of {where} failed: {type(e).__name__}: {e}"
        return StorageError(self._scrub(text))

    def put(self, key: str, chunks: Iterable[Chunk]) -> PutResult:
        reader = HashingReader(chunks)
        try:
            self.client.upload_fileobj(reader, self.bucket, self._key(key), Config=self.transfer)
        except Exception as e:  # s3transfer aborts the multipart upload on failure
            raise self._error("upload", key, e) from None
        return PutResult(size=reader.size, sha256=reader.hexdigest())

    def get(self, key: str) -> bytes:
        buf = io.BytesIO()
        try:
            self.client.download_fileobj(self.bucket, self._key(key), buf, Config=self.transfer)
        except Exception as e:
            if _is_not_found(e):
                raise ObjectMissing(f"{self.describe(key)} does not exist") from None
            raise self._error("download", key, e) from None
        return buf.getvalue()

    def size(self, key: str) -> int | None:
        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"])
        except Exception as e:
            if _is_not_found(e):
                return None
            raise self._error("head", key, e) from None

    def list(self, prefix: str = "") -> dict[str, int]:
        full = self._key(prefix) if prefix else (f"{self.prefix}/" if self.prefix else "")
        strip = len(self.prefix) + 1 if self.prefix else 0
        keys: dict[str, int] = {}
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=full
            ):
                keys.update((obj["Key"][strip:], int(obj["Size"])) for obj in page.get("Contents", []))
        except Exception as e:
            raise self._error("list", prefix, e) from None
        return dict(sorted(keys.items()))

    def delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except Exception as e:
            if not _is_not_found(e):
                raise self._error("delete", key, e) from None

    def delete_prefix(self, prefix: str) -> None:
        if not prefix.strip("/"):
            raise ValueError("refusing to delete the whole checkpoint root; give a step folder")
        keys = list(self.list(prefix.rstrip("/") + "/"))
        try:
            for i in range(0, len(keys), 1000):
                batch = [{"Key": self._key(k)} for k in keys[i : i + 1000]]
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
        except Exception as e:
            raise self._error("delete", prefix, e) from None

    def close(self) -> None:
        self.client.close()


def _is_not_found(e: Exception) -> bool:
    from botocore.exceptions import ClientError

    if isinstance(e, ClientError):
        return e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound")
    return False
