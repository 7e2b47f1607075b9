"""The engine's typed configuration: model, data, training and parallelism.

Plain pydantic, no torch: the SDK, the CLI and the API validate job files with these
classes without loading the engine. Every layout rule (tp divides heads, mesh sizes multiply to
the world, the pipeline schedule's stages) lives in `parallel.dims`, the layout authority;
ParallelConfig asks it about what its own section decides.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from parallel.layout_rules import parallelism_problems, stages_per_rank


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
    "qwen2.5-0.5b": dict(
        family="qwen2", vocab_size=151936, dim=896, n_layers=24, n_heads=14, n_kv_heads=2, hidden_dim=4864,
        rope_theta=1000000.0, norm_eps=1e-6, max_seq_len=32768, tie_embeddings=True,
    ),
    "qwen3-0.6b": dict(
        family="qwen3", vocab_size=151936, dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128,
        hidden_dim=3072, rope_theta=1000000.0, norm_eps=1e-6, max_seq_len=40960, tie_embeddings=True,
    ),
    "mistral-7b": dict(
        family="mistral", vocab_size=32768, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden_dim=14336,
        rope_theta=1000000.0, max_seq_len=32768,
    ),
}

ModelFamily = Literal["llama", "mistral", "qwen2", "qwen3", "mixtral"]


class ModelConfig(_Strict):
    """A Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU); with `moe` set, Mixtral-style; with q/k/v
    biases, Qwen2-style; with q/k RMSNorm (and often a head_dim of its own), Qwen3-style.

    `family` names the Hugging Face architecture `init_from` reads and `export-hf` writes; unset, it
    follows from the shape (moe: mixtral, qk_norm: qwen3, qkv_bias: qwen2, else llama), and a family
    sets its features (qwen2: qkv_bias, qwen3: qk_norm). After validation family, qkv_bias, qk_norm
    and head_dim always hold their resolved values.
    """

    preset: str | None = Field(None, description=f"one of {sorted(MODEL_PRESETS)}; other fields override it")
    vocab_size: int = Field(256, ge=2)
    dim: int = Field(64, ge=1)
    n_layers: int = Field(2, ge=1)
    n_heads: int = Field(4, ge=1)
    n_kv_heads: int | None = Field(None, ge=1, description="default: n_heads (no grouping)")
    hidden_dim: int | None = Field(None, ge=1, description="MLP width; default: Llama's 8/3·dim rounding")
    ffn_dim_multiplier: float | None = Field(None, gt=0, le=64, description="MLP width x this (Llama 3: 1.3)")
    multiple_of: int = Field(16, ge=1)
    norm_eps: float = Field(1e-5, gt=0, le=1)
    rope_theta: float = Field(10000.0, gt=0)
    max_seq_len: int = Field(4096, ge=1)
    tie_embeddings: bool = False
    head_dim: int | None = Field(None, ge=2, description="attention head width; default: dim / n_heads")
    qkv_bias: bool | None = Field(None, description="biases on the q/k/v projections (Qwen2); default: the family's")
    qk_norm: bool | None = Field(None, description="RMSNorm of each q/k head before RoPE (Qwen3); default: the family's")
    family: ModelFamily | None = Field(None, description="the Hugging Face architecture; default: from the shape")
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

    # Which of the resolved fields were derived (not given): re-derived when the config changes.
    _derived: frozenset[str] = PrivateAttr(default=frozenset())

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        derived = set(self._derived) | {f for f in ("head_dim", "qkv_bias", "qk_norm", "family")
                                       if self.__dict__[f] is None}
        if "head_dim" in derived:
            if self.dim % self.n_heads:
                raise ValueError(f"n_heads={self.n_heads} does not divide dim={self.dim}; pick a divisor of dim "
                                 "(or give head_dim)")
            self.__dict__["head_dim"] = self.dim // self.n_heads
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE; change dim, n_heads or head_dim")
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_kv_heads={self.kv_heads} does not divide n_heads={self.n_heads}; pick a divisor of n_heads"
            )
        given_family = None if "family" in derived else self.family
        if given_family is None:
            family = ("mixtral" if self.moe is not None else "qwen3" if self.qk_norm and "qk_norm" not in derived
                      else "qwen2" if self.qkv_bias and "qkv_bias" not in derived else "llama")
        else:
            family = given_family
        wants = {"qwen2": {"qkv_bias": True, "qk_norm": False}, "qwen3": {"qkv_bias": False, "qk_norm": True}}
        for feature in ("qkv_bias", "qk_norm"):
            want = wants.get(family, {}).get(feature, False)
            if feature in derived:
                self.__dict__[feature] = want
            elif self.__dict__[feature] != want:
                raise ValueError(f"model.{feature}={self.__dict__[feature]} but the {family} family has "
                                 f"{feature}={want}; drop {feature} or choose another family")
        if (family == "mixtral") != (self.moe is not None):
            raise ValueError("model.family=mixtral needs model.moe, and model.moe needs family mixtral; "
                             "set both or neither")
        self.__dict__["family"] = family
        self._derived = frozenset(derived)
        return self

    def __eq__(self, other: object) -> bool:
        """Equal when every field is (what was derived and what was given alike)."""
        return isinstance(other, ModelConfig) and self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]  # mutable, as every BaseModel

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block `layer_id` has experts (every `moe.every_n_layers`-th, the last of each run);
        the model builds its blocks by it and the planner counts them by it."""
        return self.moe is not None and layer_id % self.moe.every_n_layers == self.moe.every_n_layers - 1

    @property
    def ffn_dim(self) -> int:
        """The SwiGLU width, computed as Llama does when not given."""
        if self.hidden_dim is not None:
            return self.hidden_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


DataKind = Literal["synthetic", "text", "tokens", "jsonl", "parquet", "hf_dataset"]
DataFormat = Literal["text", "prompt_completion", "chat"]
TokenDtype = Literal["uint8", "uint16", "int32", "uint32"]

# The fields that say where a data set's tokens come from: shared by the training set (DataConfig) and
# an evaluation set (EvalDataConfig, where each one left unset is the training set's).
SOURCE_FIELDS: tuple[str, ...] = (
    "kind", "path", "token_dtype", "tokenizer", "eos_token", "text_field", "hf_split", "format", "chat_template",
)


class EvalDataConfig(_Strict):
    """A held-out set: `{split: 0.01}` of the training windows, or a data set of its own
    (`{kind: jsonl, path: ...}`; each field left unset is the training data's)."""

    split: float | None = Field(
        None, gt=0, lt=1, description="hold out this fraction of the training windows (never trained on)"
    )
    sequences: int = Field(64, ge=1, description="windows of training.seq_len evaluated: the set's first N")
    kind: DataKind | None = None
    path: str | None = None
    token_dtype: TokenDtype | None = None
    tokenizer: str | None = None
    eos_token: str | None = None
    text_field: str | None = None
    hf_split: str | None = None
    format: DataFormat | None = None
    chat_template: str | None = None

    @model_validator(mode="after")
    def _check(self) -> EvalDataConfig:
        if self.split is None and self.path is None:
            raise ValueError("data.eval needs a held-out set: split (a fraction of the training data) or a path")
        if self.split is not None:
            given = [f for f in SOURCE_FIELDS if getattr(self, f) is not None]
            if given:
                raise ValueError(
                    f"data.eval.split holds out training data, so {', '.join('data.eval.' + f for f in given)} "
                    "cannot be set with it; drop split or those fields"
                )
        if self.kind == "synthetic":
            raise ValueError("data.eval.kind=synthetic is not a held-out set; give a data set or split")
        return self


class DataConfig(_Strict):
    """Where tokens come from. The samples of step s depend on (seed, s) alone."""

    kind: DataKind = "synthetic"
    path: str | None = Field(
        None,
        description="text: a UTF-8 file or folder of them, one document each; tokens: a flat binary file of ids "
        "or a folder written by `unbroken data prepare`; jsonl/parquet: a file or a folder of them; "
        "hf_dataset: a folder written by datasets' save_to_disk",
    )
    token_dtype: TokenDtype = Field("uint16", description="flat tokens files only (a prepared folder records its own)")
    seed: int = 0
    tokenizer: str | None = Field(
        None, description="a tokenizer.json or a Hugging Face folder holding one; default: byte-level (ids 0..255)"
    )
    eos_token: str | None = Field(
        None, description="the end-of-document token; default: tokenizer_config.json's eos_token or a well-known one"
    )
    text_field: str = Field("text", min_length=1, description="jsonl/parquet/hf_dataset: the field holding the text")
    hf_split: str = Field("train", min_length=1, description="hf_dataset: the split of a DatasetDict folder")
    format: DataFormat = Field(
        "text",
        description="text: plain documents; prompt_completion: fields prompt and completion, loss on the completion; "
        "chat: a messages list rendered with the chat template, loss on the assistant turns",
    )
    chat_template: str | None = Field(None, description="format chat: a Jinja template; default: the tokenizer's")
    document_mask: bool = Field(False, description="attention stays inside each packed document")
    on_bad_row: Literal["fail", "skip"] = Field(
        "fail", description="a row that is not UTF-8/JSON or lacks its field: refuse the data set, or skip the row"
    )
    eval: EvalDataConfig | None = Field(None, description="a held-out set evaluated every training.eval_every steps")

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.kind != "synthetic" and not self.path:
            raise ValueError(f"data.kind={self.kind!r} needs data.path; set it or use kind: synthetic")
        if self.kind == "synthetic" and self.document_mask:
            raise ValueError("data.document_mask needs documents; synthetic data has none (use text, jsonl, ...)")
        if self.format != "text" and self.kind in ("synthetic", "text"):
            raise ValueError(
                f"data.format={self.format} reads records (jsonl, parquet, hf_dataset or a prepared folder); "
                f"data.kind={self.kind} has none"
            )
        if self.eval is not None and self.eval.split is not None and self.kind == "synthetic":
            raise ValueError("data.eval.split holds out part of a finite data set; synthetic data is endless: "
                             "give data.eval a kind and path instead")
        return self

    def eval_data(self) -> DataConfig | None:
        """The evaluation set as a data section of its own (its unset fields are the training set's);
        None without data.eval, and the training section itself for `split`."""
        if self.eval is None:
            return None
        if self.eval.split is not None:
            return self
        given = {f: getattr(self.eval, f) for f in SOURCE_FIELDS if getattr(self.eval, f) is not None}
        source = {f: getattr(self, f) for f in SOURCE_FIELDS}
        return DataConfig(**{**source, **given, "seed": self.seed, "on_bad_row": self.on_bad_row,
                             "document_mask": self.document_mask})


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
    output_dir: str | None = Field(
        None,
        description="metrics.jsonl, the final state and local checkpoints go here; default: a folder of the "
        "job's own ($UNBROKEN_HOME/runs/<job-id> under `unbroken serve`, runs/<run-id> for train and run)",
    )
    log_every: int = Field(1, ge=1)
    eval_every: int | None = Field(
        None, ge=1, description="evaluate data.eval every N steps and after the last; default: after the last only"
    )

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
    fsdp_unit_mib: float = Field(
        25.0, ge=0,
        description="consecutive transformer blocks are grouped into FSDP units of at least this many MiB of "
        "parameters (parallel.layout_rules.fsdp_units): one all-gather and one reduce-scatter a unit, so a small model "
        "is not paced by a collective per block; 0: one unit per block",
    )
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
        stages = stages_per_rank(self.pp_schedule, self.pp, self.pp_stages_per_rank)
        if stages != self.pp_stages_per_rank:
            self.pp_stages_per_rank = stages
        problems = parallelism_problems(self)
        if problems:
            raise ValueError("; ".join(str(p) for p in problems))
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


def resolve_local_paths(model: ModelConfig, data: DataConfig) -> None:
    """Make a job's local paths absolute, in place, as its author meant them (relative to the folder the
    command runs in), whatever folder a rank later reads them in: data (and eval) paths and tokenizers,
    and model.init_from."""
    from pathlib import Path

    def absolute(p: str | None) -> str | None:
        return None if p is None else str(Path(p).expanduser().resolve())

    data.path, data.tokenizer = absolute(data.path), absolute(data.tokenizer)
    if data.eval is not None:
        data.eval.path, data.eval.tokenizer = absolute(data.eval.path), absolute(data.eval.tokenizer)
    model.init_from = absolute(model.init_from)
