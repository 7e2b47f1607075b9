"""The job spec: the engine's sections plus resources, checkpointing, fault tolerance and chaos.

This is the wire contract of `POST /v1/jobs`, the SDK and `unbroken submit`. It imports no
torch or ray, so the SDK and CLI stay light.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from checkpointing.config import CheckpointConfig
from parallel.config import EngineConfig, format_validation_error


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DPRange(_Strict):
    """The data-parallel degree may move between min and max as workers fail and return."""

    min: int = Field(1, ge=1)
    max: int | None = Field(None, ge=1, description="default: the parallelism section's dp size")

    @model_validator(mode="after")
    def _check(self) -> DPRange:
        if self.max is not None and self.max < self.min:
            raise ValueError(f"dp.max={self.max} is below dp.min={self.min}; raise max or lower min")
        return self


# Spare replicas a job may keep: each holds a replica's resources while it waits.
MAX_SPARES = 16


class Resources(_Strict):
    dp: DPRange = Field(default_factory=DPRange)
    cpus_per_worker: float = Field(1.0, ge=0, le=1024)
    gpus_per_worker: float = Field(0.0, ge=0, le=16, description="one rank drives at most a node's GPUs")
    custom: dict[str, Annotated[float, Field(ge=0, le=1e9)]] = Field(
        default_factory=dict, description="extra Ray resources per worker"
    )
    spares: int = Field(0, description="warm spare replicas kept beside the group (workers started, data "
                        "opened), on other nodes where possible: a failed replica is replaced by one at the "
                        "next generation, so dp does not shrink. Each holds a replica's resources.")
    fork_workers: bool = Field(True, description="start each worker process as a fork of a per-node process "
                               "that imported torch and the engine once (workers.zygote), instead of a fresh "
                               "interpreter: a replacement, spare or grow-back costs ~0.5 CPU-s instead of "
                               "~3.5 on the node's training cores. Linux only; false starts each one fresh.")

    @model_validator(mode="after")
    def _names(self) -> Resources:
        bad = [k for k in self.custom if not k or not k.isprintable() or len(k) > 128]
        if bad:
            raise ValueError(f"custom resource names must be 1-128 printable characters; fix {bad[:3]!r}")
        return self

    @field_validator("spares")
    @classmethod
    def _spares(cls, n: int) -> int:
        if n < 0:
            raise ValueError(f"spares={n} is negative; give the number of warm spare replicas to keep: 0 (none) "
                             "or more")
        if n > MAX_SPARES:
            raise ValueError(f"spares={n} is more than {MAX_SPARES}; each spare holds a whole replica's "
                             f"resources: keep at most {MAX_SPARES} (one or two cover a failure at a time)")
        return n


class FaultTolerance(_Strict):
    heartbeat_interval_s: float = Field(1.0, gt=0)
    heartbeat_timeout_s: float = Field(10.0, gt=0, description="a worker silent this long is hung")
    collective_timeout_s: float = Field(30.0, gt=0, description="floor of the process-group timeout")
    max_recoveries: int = Field(10, ge=0)
    wait_for_capacity_s: float = Field(60.0, ge=0, description="below dp.min, wait this long, then fail")
    straggler_factor: float = Field(3.0, gt=1, description="step time over k x the median is a straggler")
    straggler_action: Literal["warn", "replace"] = "warn"
    supervisor_max_restarts: int = Field(3, ge=0)
    restart_from_scratch: bool = Field(False, description="after training progressed, a failure with no "
                                       "snapshot and no persistent checkpoint to restore restarts from step 0 "
                                       "(an event says so) instead of failing the job")
    keep_trainer: bool = Field(True, description="a worker whose place (rank, world size, dp) the next "
                               "generation keeps trains on in the model, optimizer and data it holds, after "
                               "restoring the snapshot into them; false builds them anew at every re-form")

    @model_validator(mode="after")
    def _check(self) -> FaultTolerance:
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("heartbeat_timeout_s must exceed heartbeat_interval_s")
        return self


ChaosKind = Literal["kill_worker", "sigkill_worker", "hang_worker", "kill_node", "slow_worker", "raise_in_step",
                    "kill_keeper", "kill_supervisor"]


ChaosAt = Literal["step", "join"]
# What may fire as a group forms (`at: join`): the losses of a process or a node, which its peers, waiting
# in the store for its address, can only learn of from the supervisor.
JOIN_KINDS = ("kill_worker", "sigkill_worker", "hang_worker", "kill_node")


class ChaosEvent(_Strict):
    """A fault injected at a step on a rank (like torchft's fail_at(rank, step)), or as a generation's
    group forms (`at: join`)."""

    kind: ChaosKind
    step: int = Field(0, ge=0, description="fire when the rank has completed this many steps (at: step)")
    rank: int = Field(0, ge=0)
    seconds: float = Field(5.0, ge=0, description="slow_worker: delay per step; hang_worker: ignored")
    generation: int | None = Field(0, ge=0, description="fire only in this generation, so it fires once; null: "
                                   "in whichever generation first reaches the rank and step, once per job")
    at: ChaosAt = Field("step", description="step: before the rank's step `step`; join: once every rank of the "
                        "generation has arrived, as the group connects (its peers wait for this rank's address)")


# A fault that stops its worker (or hangs it): nothing later at the same rank, step and generation fires.
_FATAL_KINDS = frozenset({"kill_worker", "sigkill_worker", "hang_worker", "kill_node", "raise_in_step"})


def chaos_spec_problems(chaos: list[ChaosEvent], steps: int) -> list[tuple[tuple[int | str, ...], str, Any]]:
    """(location under chaos, message, bad value) for each event that can never fire, whatever the
    cluster: a worker checks its faults before each of its steps 0..steps-1 (workers.chaos), once each."""
    out: list[tuple[tuple[int | str, ...], str, Any]] = []
    first_at: dict[tuple[int, int, int | None, str], int] = {}
    # Every kind that fires at join stops its worker before the generation's first step.
    stopped_at_join: dict[tuple[int, int | None], int] = {}
    for k, e in enumerate(chaos):
        if e.at == "join":
            stopped_at_join.setdefault((e.rank, e.generation), k)
    for i, ev in enumerate(chaos):
        what = chaos_what(ev)
        if ev.at == "join":
            if ev.kind not in JOIN_KINDS:
                out.append(((i, "kind"), f"{ev.kind} cannot fire as a group connects (at: join): use one of "
                            f"{', '.join(JOIN_KINDS)}, or at: step", ev.kind))
                continue
            if ev.step:
                out.append(((i, "step"), f"{ev.kind} at: join with step {ev.step}: a fault at join fires as the "
                            "generation's group connects, before its first step; leave step out (or 0), and pick "
                            "the generation", ev.step))
                continue
        if ev.step >= steps:
            out.append(((i, "step"), f"{what} never fires: an event fires when its rank has completed `step` "
                        f"steps, and this job stops at training.steps={steps}; pick a step below {steps}", ev.step))
            continue
        if ev.kind == "slow_worker" and ev.seconds == 0:
            out.append(((i, "seconds"), f"{what} with seconds: 0 slows nothing; set seconds above 0",
                        ev.seconds))
        at = (ev.rank, ev.step, ev.generation, ev.at)
        j = first_at.get(at)
        if j is None:
            first_at[at] = i
        elif chaos[j] == ev or chaos[j].kind in _FATAL_KINDS:
            why = "is the same event" if chaos[j] == ev else f"({chaos[j].kind}) stops that worker first"
            out.append(((i,), f"{what} (generation {ev.generation}) never fires: chaos.{j} {why}; "
                        "move it to another step or rank, or drop it", ev.model_dump()))
            continue
        j = stopped_at_join.get((ev.rank, ev.generation)) if ev.at == "step" and ev.generation is not None else None
        if j is not None:
            out.append(((i,), f"{what} (generation {ev.generation}) never fires: chaos.{j} ({chaos[j].kind}) stops "
                        "that worker as the generation's group connects; move it to another generation or rank, "
                        "or drop it", ev.model_dump()))
    return out


def chaos_what(ev: ChaosEvent) -> str:
    """An event in words: its kind, where it fires, and on which rank."""
    where = "as its group connects" if ev.at == "join" else f"at step {ev.step}"
    return f"{ev.kind} {where} on rank {ev.rank}"


def chaos_rank_problems(chaos: list[ChaosEvent], max_world: int, why: str) -> list[tuple[str, str]]:
    """(field, message) for each event at a rank the job never has: ranks run 0..max_world-1, where
    `why` says where that bound comes from (the dp range, or the whole cluster)."""
    return [
        (f"chaos.{i}.rank", f"{chaos_what(ev)} never fires: this job has at most "
                            f"{max_world} workers ({why}), ranks 0..{max_world - 1}; pick a rank below {max_world}")
        for i, ev in enumerate(chaos) if ev.rank >= max_world
    ]


class RuntimeEnv(_Strict):
    env_vars: dict[str, str] = Field(default_factory=dict)
    secret_env_vars: dict[str, SecretStr] = Field(default_factory=dict, description="never returned or logged")
    pip: list[str] = Field(default_factory=list, description="must stay empty: no job's packages are installed "
                           "(a job naming some is refused at submission); install them in the cluster's image")


class JobSpec(EngineConfig):
    name: str = Field("job", min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    priority: int = Field(0, ge=-100, le=100, description="higher runs first; FIFO within a priority")
    resources: Resources = Field(default_factory=Resources)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    fault_tolerance: FaultTolerance = Field(default_factory=FaultTolerance)
    chaos: list[ChaosEvent] = Field(default_factory=list)
    runtime_env: RuntimeEnv = Field(default_factory=RuntimeEnv)
    tensorboard: bool = False

    @model_validator(mode="after")
    def _chaos_can_fire(self) -> JobSpec:
        """Chaos events that could never fire are refused, each at its own field (chaos.N.step, ...).
        The rank's bound depends on the layout and the cluster: see service.validation."""
        errors = [
            InitErrorDetails(type=PydanticCustomError("chaos_never_fires", "{message}", {"message": msg}),
                             loc=("chaos", *where), input=value)
            for where, msg, value in chaos_spec_problems(self.chaos, self.training.steps)
        ]
        if errors:
            raise ValidationError.from_exception_data(type(self).__name__, errors)
        return self

    def public_dict(self) -> dict[str, Any]:
        """The spec as the API returns it: secrets masked (the one masker; reveal_secrets undoes it)."""
        return json.loads(self.model_dump_json())  # SecretStr dumps as '**********'


def reveal_secrets(value: Any) -> Any:
    """A python-mode dump (model_dump(mode="python")) with its SecretStr values revealed: what goes to
    the server (the SDK) and to the job's workers (the supervisor), never what the API returns."""
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, dict):
        return {k: reveal_secrets(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [reveal_secrets(v) for v in value]
    return value


def spec_to_private_json(spec: BaseModel) -> str:
    """A spec (or one of its sections) as JSON with secret values revealed: what the supervisor needs."""
    return json.dumps(reveal_secrets(spec.model_dump(mode="python")), sort_keys=True, default=str)


class SpecError(ValueError):
    """A job file or body that does not validate; the message lists each bad field and the fix."""


def parse_spec(data: dict[str, Any] | str | bytes, *, cls: type[EngineConfig] = JobSpec) -> Any:
    """Validate a dict, or YAML/JSON text, into `cls`, raising SpecError with readable lines."""
    if isinstance(data, bytes | str):
        try:
            data = yaml.safe_load(data)
        except yaml.YAMLError as e:
            raise SpecError(f"the job file is not valid YAML or JSON: {e}") from e
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(f"a job is a mapping of sections, got {type(data).__name__}")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise SpecError(format_validation_error(e)) from e


def load_spec_file(path: str | Path, *, cls: type[EngineConfig] = JobSpec) -> Any:
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"job file {str(p)!r} does not exist")
    return parse_spec(p.read_text(encoding="utf-8"), cls=cls)
