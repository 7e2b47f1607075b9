"""The engine's typed configuration: model, data, training and parallelism.

Plain pydantic, no torch: the SDK, the CLI and the API validate job files with these
classes without loading the engine. Cross-field checks that need the world size
(tp divides heads, mesh sizes multiply to the world) live in `parallel.dims.ParallelDims`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class _Strict(BaseModel):
    """Unknown fields are errors, so a typo never silently falls back to a default."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class MoEConfig(_Strict):
    """Mixtral-style mixture of experts (used by the MoE model family)."""

    num_experts: int = Field(8, ge=1)
    top_k: int = Field(2, ge=1)
    every_n_layers: int = Field(1, ge=1, description="MoE on every n-th layer, dense MLP elsewhere")
    hidden_dim: int | None = Field(None, ge=1, description="expert MLP width; default: the dense width")
    aux_loss_coef: float = Field(0.01, ge=0.0, description="load-balancing auxiliary loss weight")

    @model_validator(mode="after")
    def _check(self) -> MoEConfig:
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}; lower top_k")
        return self


# Shapes of well-known models. Tests use "tiny"; "debug" is the demo's default.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16),
    "debug": dict(vocab_size=256, dim=128, n_layers=4, n_heads=8, n_kv_heads=4, multiple_of=32),
    "small": dict(vocab_size=256, dim=256, n_layers=8, n_heads=8, n_kv_heads=4, multiple_of=64),
    "llama3-1b": dict(
        vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
        ffn_dim_multiplier=1.5, multiple_of=256, rope_theta=500000.0, tie_embeddings=True,
    ),
    "llama3-8b": dict(
        vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
        ffn_dim_multiplier=1.3, multiple_of=1024, rope_theta=500000.0,
    ),
    "llama3-70b": dict(
        vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
        ffn_dim_multiplier=1.3, multiple_of=4096, rope_theta=500000.0,
    ),
    "mixtral-tiny": dict(
        vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16,
        moe=dict(num_experts=4, top_k=2),
    ),
    "mixtral-8x7b": dict(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden_dim=14336,
        rope_theta=1000000.0, moe=dict(num_experts=8, top_k=2),
    ),
}


class ModelConfig(_Strict):
    """A Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU); with `moe` set, Mixtral-style."""

    preset: str | None = Field(None, description=f"one of {sorted(MODEL_PRESETS)}; other fields override it")
    vocab_size: int = Field(256, ge=2)
    dim: int = Field(64, ge=1)
    n_layers: int = Field(2, ge=1)
    n_heads: int = Field(4, ge=1)
    n_kv_heads: int | None = Field(None, ge=1, description="default: n_heads (no grouping)")
    hidden_dim: int | None = Field(None, ge=1, description="MLP width; default: Llama's 8/3·dim rounding")
    ffn_dim_multiplier: float | None = Field(None, gt=0)
    multiple_of: int = Field(16, ge=1)
    norm_eps: float = Field(1e-5, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
    max_seq_len: int = Field(4096, ge=1)
    tie_embeddings: bool = False
    moe: MoEConfig | None = None
    init_seed: int = Field(0, description="weights depend on this seed alone, never on the layout")
    init_from: str | None = Field(None, description="a Hugging Face folder (export-hf output) to start from")

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preset") is not None:
            name = data["preset"]
            if not isinstance(name, str) or name not in MODEL_PRESETS:
                raise ValueError(f"unknown preset {name!r}; choose one of {sorted(MODEL_PRESETS)}")
            return {**MODEL_PRESETS[name], **data}
        return data

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.dim % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} does not divide dim={self.dim}; pick a divisor of dim")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head_dim={self.dim // self.n_heads} must be even for RoPE; change dim or n_heads")
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_kv_heads={self.kv_heads} does not divide n_heads={self.n_heads}; pick a divisor of n_heads"
            )
        return self

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        """The SwiGLU width, computed as Llama does when not given."""
        if self.hidden_dim is not None:
            return self.hidden_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


class DataConfig(_Strict):
    """Where tokens come from. The samples of step s depend on (seed, s) alone."""

    kind: Literal["synthetic", "text", "tokens"] = "synthetic"
    path: str | None = Field(
        None, description="text: a UTF-8 file or folder of files (byte-level); tokens: a flat binary file"
    )
    token_dtype: Literal["uint8", "uint16", "int32"] = Field("uint16", description="tokens files only")
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.kind != "synthetic" and not self.path:
            raise ValueError(f"data.kind={self.kind!r} needs data.path; set it or use kind: synthetic")
        return self


class TrainConfig(_Strict):
    steps: int = Field(20, ge=1)
    seq_len: int = Field(64, ge=2)
    global_batch_size: int = Field(8, ge=1, description="sequences per step, fixed whatever the dp degree")
    micro_batch_size: int | None = Field(
        None, ge=1, description="sequences per forward on one rank; default: the whole per-rank share"
    )
    lr: float = Field(3e-4, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine decays to lr·min_lr_ratio")
    warmup_steps: int = Field(2, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float | None = Field(1.0, gt=0, description="max global grad norm; null disables clipping")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="bfloat16: bf16 compute, fp32 reduce")
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    compile: bool = False
    seed: int = Field(0, description="seeds dropout-free RNG state (kept in the train state)")
    output_dir: str = Field("runs/latest", description="metrics.jsonl and local checkpoints go here")
    log_every: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} exceeds steps={self.steps}; lower it")
        return self


class ParallelConfig(_Strict):
    """Mesh sizes. dp_shard=-1 fills the world with whatever the other sizes leave."""

    auto: bool = Field(False, description="let the planner choose (`parallelism: auto` in a job file)")
    dp_replicate: int = Field(1, ge=1, description=">1 with dp_shard>1 is HSDP")
    dp_shard: int = Field(-1, ge=-1)
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    cp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)
    zero_stage: Literal[1, 2, 3] = Field(3, description="1/2: gradients or states only sharded; 3: full FSDP")
    sequence_parallel: bool = True
    loss_parallel: bool = True
    cpu_offload: bool = False
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"] = "1f1b"
    pp_microbatches: int | None = Field(None, ge=1, description="default: pp (must be >= pp)")
    pp_stages_per_rank: int = Field(1, ge=1, description="virtual stages (interleaved schedules)")
    pp_split: list[int] | None = Field(None, description="layers per stage; default: even")
    cp_impl: Literal["ring", "builtin"] = "ring"

    @model_validator(mode="before")
    @classmethod
    def _auto(cls, data: Any) -> Any:
        return {"auto": True} if data == "auto" else data

    @model_validator(mode="after")
    def _check(self) -> ParallelConfig:
        if self.dp_shard == 0:
            raise ValueError("dp_shard=0 is not a size; use -1 to fill the world or a positive size")
        if self.pp_microbatches is not None and self.pp_microbatches < self.pp:
            raise ValueError(f"pp_microbatches={self.pp_microbatches} must be >= pp={self.pp}")
        if self.pp_schedule in ("interleaved_1f1b", "zero_bubble") and self.pp > 1 and self.pp_stages_per_rank < 2:
            self.pp_stages_per_rank = 2
        if self.pp_schedule == "zbv" and self.pp > 1 and self.pp_stages_per_rank != 2:
            raise ValueError("pp_schedule=zbv uses exactly 2 stages per rank; set pp_stages_per_rank: 2")
        return self


class EngineConfig(_Strict):
    """What the engine needs to train: the sections of a job file the local launcher reads."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    training: TrainConfig = Field(default_factory=TrainConfig)
    parallelism: ParallelConfig = Field(default_factory=ParallelConfig)


def format_validation_error(err: ValidationError, prefix: str = "") -> str:
    """One line per bad field: `model.n_heads: <reason>`, so users know what to fix."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in (prefix, *e["loc"]) if p != "")
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{loc or '(top level)'}: {msg}")
    return "\n".join(lines)
