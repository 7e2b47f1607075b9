"""Checkpointing's own configuration: the two tiers and where persistent checkpoints go.

Plain pydantic, no torch, so the SDK can validate a job's `checkpoint` section.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator


class S3Config(BaseModel):
    """Optional explicit S3 settings; without them boto3's standard credential chain is used."""

    model_config = ConfigDict(extra="forbid")

    endpoint_url: str | None = Field(None, description="e.g. http://127.0.0.1:8333 for a local server")
    region: str | None = None
    access_key_id: SecretStr | None = None
    secret_access_key: SecretStr | None = None
    max_concurrency: int = Field(8, ge=1, description="parallel multipart parts")
    part_size_mb: int = Field(8, ge=5, description="multipart part size (S3 minimum is 5 MiB)")
    max_attempts: int = Field(5, ge=1, description="retries with exponential backoff")
    read_timeout_s: float = Field(30.0, gt=0)

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError(f"endpoint_url {v!r} must start with http:// or https:// (e.g. http://127.0.0.1:8333)")
        return v

    @model_validator(mode="after")
    def _key_pair(self) -> S3Config:
        if (self.access_key_id is None) != (self.secret_access_key is None):
            given, missing = ("access_key_id", "secret_access_key") if self.secret_access_key is None else (
                "secret_access_key", "access_key_id")
            raise ValueError(f"{given} is set without {missing}: set both, or neither (then boto3's standard "
                             "credential chain is used)")
        return self


class CheckpointConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    uri: str | None = Field(
        None,
        description="file:///path or s3://bucket/prefix: a root shared by jobs, each writing under "
        "<uri>/<job-id>; default: <output_dir>/checkpoints",
    )
    in_memory_every: int = Field(1, ge=0, description="steps between in-memory snapshots; 0 disables")
    persist_every: int = Field(50, ge=0, description="steps between persistent checkpoints; 0 disables")
    keep_last: int = Field(3, ge=1, description="persistent checkpoints kept (retention)")
    keeper_memory_limit_mb: int = Field(4096, ge=1, description="per keeper; larger snapshots are refused")
    heal_from_peer: bool = Field(True, description="with data-parallel replicas (HSDP, DDP), one rank of each "
                                 "replica group reads a snapshot at a restore and the others take it from it over "
                                 "the group; false: every rank reads the keepers")
    snapshot_shared_memory: bool = Field(True, description="CPU ranks hand their snapshot to their own node's "
                                         "keeper through a /dev/shm segment; false: over its socket, as to the "
                                         "other node's")
    resume: bool = Field(
        True, description="start from the newest valid checkpoint of this job's own, if any (never another job's)"
    )
    resume_from: str | None = Field(
        None,
        description="start from another run's checkpoints: a checkpoint root or one step folder (file:// or "
        "s3://), read only; the newest valid one of a root",
    )
    s3: S3Config = Field(default_factory=S3Config)

    @field_validator("uri", "resume_from")
    @classmethod
    def _scheme(cls, v: str | None) -> str | None:
        if v is not None and not (v.startswith("file://") or v.startswith("s3://")):
            raise ValueError(f"uri {v!r} must start with file:// or s3:// (e.g. s3://bucket/prefix)")
        if v is not None and v.startswith("s3://") and len(v) <= len("s3://"):
            raise ValueError("uri s3:// needs a bucket: s3://bucket/prefix")
        return v
