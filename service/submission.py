"""Submitting a job: the policy between a decoded request body and a stored, scheduled job.

`submit(...)` checks the spec (its own pydantic checks, `parallelism: auto` resolved against the
cluster, every submit check of service.validation), stores it (an Idempotency-Key replays the
stored job), records the layout auto chose and the run-time warnings as the job's events, and
tells the scheduler. It knows nothing of HTTP: a refusal raises SubmissionRefused with (field,
message) problems, which the API answers as a 422; a reused Idempotency-Key raises the store's
IdempotencyConflictError.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from service import sizing
from service.estimate import RunEstimate, estimate_run, long_job_warnings
from service.spec import JobSpec
from service.store import JobRecord, JobStore


class SubmissionRefused(ValueError):
    """A job that is not accepted; `problems` are (field, message naming the fix) pairs."""

    def __init__(self, message: str, problems: list[tuple[str, str]]) -> None:
        super().__init__(message)
        self.message = message
        self.problems = list(problems)


@dataclass
class Submitted:
    job: JobRecord
    created: bool  # False: an Idempotency-Key replay of a job already stored
    estimate: RunEstimate | None
    warnings: list[str] = field(default_factory=list)


def parse_job_spec(data: Any) -> JobSpec:
    """A decoded body as a JobSpec (its own pydantic checks only); SubmissionRefused naming each bad field."""
    if not isinstance(data, dict):
        raise SubmissionRefused(f"a job spec is a mapping of sections, got {type(data).__name__}",
                                [("body", "must be an object with sections model, data, training, ...")])
    try:
        return JobSpec.model_validate(data)
    except ValidationError as e:
        fields = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
            fields.append((loc, err["msg"].removeprefix("Value error, ")))
        lines = "; ".join(f"{f}: {m}" for f, m in fields)
        raise SubmissionRefused(f"the job spec is invalid: {lines}", fields) from e


def checked_spec(data: Any, cluster_total: Mapping[str, float] | None) -> tuple[JobSpec, Any]:
    """(spec, auto): the spec to store, with `parallelism: auto` resolved to a concrete layout (auto:
    the service.autolayout.AutoLayout chosen, else None); SubmissionRefused if it cannot run."""
    from service.validation import job_problems

    spec = parse_job_spec(data)
    total = dict(cluster_total) if cluster_total is not None else None
    auto = None
    if spec.parallelism.auto:
        from service.autolayout import LayoutRefused, cluster_for_job, resolve_auto

        if total is None:
            msg = ("auto needs a cluster to plan for and this server has none (store-only, no cluster view); "
                   "set the parallel sizes explicitly, e.g. parallelism: {dp_shard: -1}")
            raise SubmissionRefused(f"parallelism: {msg}", [("parallelism", msg)])
        try:
            auto = resolve_auto(spec, cluster_for_job(spec, total), total)
        except LayoutRefused as e:
            # Only parallelism is named: the cluster is the server's, not a field of this request.
            problems = [("parallelism", m if f == "parallelism" else f"{f}: {m}") for f, m in e.problems]
            lines = "; ".join(m for _, m in problems)
            raise SubmissionRefused(f"parallelism: auto found no layout: {lines}", problems) from e
        spec = auto.spec
    problems = job_problems(spec, total)
    if problems:
        raise SubmissionRefused("the job cannot run: " + "; ".join(f"{f}: {m}" for f, m in problems), problems)
    return spec, auto


def submit(store: JobStore, scheduler: Any | None, data: Any, owner: str, *,
           cluster_total: Mapping[str, float] | None, idempotency_key: str | None = None) -> Submitted:
    """Check, store and schedule one job for `owner` (see the module's docstring)."""
    spec, auto = checked_spec(data, cluster_total)
    min_world, max_world = sizing.job_world_size(spec)
    rec, created = store.create_job(spec, owner, min_world=min_world, max_world=max_world,
                                    idempotency_key=idempotency_key or None)
    estimate = estimate_run(spec, cluster_total, auto.candidate if auto else None)
    warnings = long_job_warnings(spec, estimate)
    if created:
        if auto is not None:
            store.add_event(rec.id, "layout_chosen", auto.event_message(), auto.event_data())
        for text in warnings:
            store.add_event(rec.id, "warning", text, {"estimate": estimate.to_dict() if estimate else None})
        if scheduler is not None:
            scheduler.notify()
    return Submitted(rec, created, estimate, warnings)
