"""The REST API's request and response models (pydantic only: the SDK uses them too)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from service.statuses import TERMINAL, JobStatus


class Progress(BaseModel):
    """The newest metrics row of a job (absent until its first step)."""

    step: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    eval_loss: float | None = Field(None, description="the newest held-out loss (jobs with data.eval)")
    tokens_per_s: float | None = None
    dp: int | None = None
    target_dp: int | None = Field(None, description="the dp the scheduler asked the job to run at (it "
                                  "differs from dp while a resize is under way)")
    world_size: int | None = None
    generation: int | None = None
    recoveries: int = 0
    spares: int | None = Field(None, description="warm spare replicas ready beside the group at the last step "
                               "(jobs with resources.spares)")


class RunEstimate(BaseModel):
    """The planner's estimate of a job's run time on this cluster (a model, not a measurement)."""

    step_time_s: float
    duration_s: float = Field(description="step_time_s x training.steps, at the job's largest size here")
    basis: str = Field(description="which layout on which cluster the planner timed")


class Job(BaseModel):
    id: str
    name: str
    owner: str
    status: JobStatus
    reason: str | None = None
    priority: int
    min_world: int
    max_world: int | None = Field(None, description="null: grows to fill the cluster")
    created_at: float = Field(description="UNIX seconds")
    updated_at: float
    admitted_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    cancel_requested: bool = False
    progress: Progress
    spec: dict[str, Any] | None = Field(None, description="the job spec, secrets masked (absent in lists)")
    estimate: RunEstimate | None = Field(None, description="in the submit answer only: how long it would run")
    warnings: list[str] = Field(default_factory=list, description="in the submit answer only: what may be "
                                "unintended (also recorded as `warning` events)")

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


class JobList(BaseModel):
    items: list[Job]
    next_cursor: str | None = Field(None, description="pass as ?cursor= for the next page; null on the last")


class JobEvent(BaseModel):
    id: int
    job_id: str
    ts: float
    kind: str
    message: str
    data: dict[str, Any] | None = None


class EventList(BaseModel):
    items: list[JobEvent]


class MetricsList(BaseModel):
    items: list[dict[str, Any]] = Field(description="one row a step: step, loss, tokens, dp, world_size, ...")


class LogLine(BaseModel):
    id: int
    ts: float
    source: str | None = Field(None, description='where it came from: "rank 0", "supervisor", ...')
    line: str


class LogList(BaseModel):
    items: list[LogLine]
    next_after: int = Field(description="pass as ?after= to read only newer lines")


class Checkpoint(BaseModel):
    step: int
    uri: str
    tier: str
    ts: float
    data: dict[str, Any] | None = None


class CheckpointList(BaseModel):
    items: list[Checkpoint]


class Goodput(BaseModel):
    """How much of a job's wall time since its first step went into steps (service.goodput)."""

    steps: int = Field(description="steps with a metrics row")
    wall_s: float = Field(description="from the first step's start to the last step's end")
    step_s: float = Field(description="the steps' own time")
    paused_s: float = Field(description="training paused by re-forms: recoveries, spare swaps, grows, shrinks")
    other_s: float = Field(description="the rest: between steps, neither a step nor a re-form (data, evaluation, "
                                       "a checkpoint's wait)")
    ratio: float | None = Field(description="step_s / wall_s; null before the first timed step")
    pauses: int = Field(description="re-forms whose pause was measured")
    paused_by_cause: dict[str, float] = Field(description="seconds paused by cause: a failure's kind, growth, "
                                                          "scheduler, ...")
    lost_steps: int = Field(description="steps trained again after recoveries")
    # (a default: an older server's answer has no summary, and a newer client still reads the figures)
    summary: str = Field("-", description='all of it in one line for people, e.g. "0.93 of 81.2s since step 1 in '
                                          'steps; paused 4.1s in 6 re-forms (worker_died 2.9s, growth 1.2s)"; "-" '
                                          "before a timed step")


class FieldError(BaseModel):
    field: str
    message: str


class ErrorBody(BaseModel):
    error: str = Field(description="unauthorized | forbidden | not_found | conflict | validation_failed | ...")
    message: str
    fields: list[FieldError] = Field(default_factory=list)


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    detail: dict[str, Any] = Field(default_factory=dict)
