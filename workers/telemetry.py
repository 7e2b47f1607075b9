"""The job's Ray metrics: definitions, and the record functions the worker and supervisor call.

Ray exports `ray.util.metrics` through each node's metrics agent on `--metrics-export-port`
(`/metrics`, Prometheus text) with the prefix `ray_`, about 10 s after they are recorded; the
Grafana dashboard in deploy/grafana/unbroken.json reads them under those names.

Metrics are created lazily, once per process, on first use: `ray.util.metrics` needs a connected
Ray worker, and the same rank code also runs under the local launcher without Ray, where every
record function here does nothing. Label values are strings (Prometheus labels).

Ray's histograms count exactly per bucket but report `_sum` from bucket midpoints (0.1 s in the
(0.1, 0.25] bucket adds 0.175): use their counts and buckets, and gauges where the exact value
matters (the step time is a gauge for that reason).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, Protocol

from checkpointing.keeper import MEMORY_METRIC, MEMORY_METRIC_HELP

log = logging.getLogger("unbroken.telemetry")
_P = ParamSpec("_P")

PREFIX = "ray_"  # what Ray's exporter puts before every application metric

# Buckets (seconds) for durations: a tiny CPU step is ~10 ms, a large checkpoint minutes.
DURATION_BUCKETS_S: list[float] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600]

JOB_RANK = ("job_id", "rank")


class StepLike(Protocol):
    """What record_step reads: `parallel.trainer.StepMetrics` has these fields."""

    step: int
    loss: float
    step_time_s: float
    tokens_per_s: float
    mfu: float | None


@dataclass(frozen=True)
class MetricDef:
    name: str  # as defined in Ray, without the ray_ prefix
    kind: str  # "gauge", "counter" or "histogram"
    description: str
    tag_keys: tuple[str, ...]
    recorded_by: str = __name__  # the module whose process sets it (the others only list it)

    @property
    def exported(self) -> list[str]:
        """The series names Prometheus shows for this metric."""
        base = PREFIX + self.name
        if self.kind == "histogram":
            return [base + "_bucket", base + "_sum", base + "_count"]
        return [base]


# The one list of what the runtime exports; the dashboard test checks every query against it.
METRICS: tuple[MetricDef, ...] = (
    MetricDef("unbroken_step_time_s", "gauge", "wall time of the last training step", JOB_RANK),
    MetricDef("unbroken_tokens_per_s", "gauge", "tokens per second of the whole job at the last step", JOB_RANK),
    MetricDef("unbroken_mfu", "gauge", "model FLOPs utilisation at the last step (GPU only)", JOB_RANK),
    MetricDef("unbroken_loss", "gauge", "training loss at the last step (global mean)", JOB_RANK),
    MetricDef("unbroken_eval_loss", "gauge", "loss on the held-out set (data.eval) at its last evaluation", JOB_RANK),
    MetricDef("unbroken_step", "gauge", "the last completed training step", JOB_RANK),
    MetricDef("unbroken_heartbeat_age_s", "gauge", "seconds since the supervisor last heard from a rank", JOB_RANK),
    MetricDef("unbroken_snapshot_seconds", "histogram", "time to take one in-memory snapshot", JOB_RANK),
    MetricDef("unbroken_snapshot_bytes", "gauge", "bytes of the last in-memory snapshot of a rank", JOB_RANK),
    MetricDef("unbroken_checkpoint_seconds", "histogram", "time to write one persistent checkpoint", JOB_RANK),
    MetricDef("unbroken_checkpoint_bytes", "gauge", "bytes of the last persistent checkpoint of a rank", JOB_RANK),
    MetricDef("unbroken_recoveries_total", "counter", "recoveries of a job, by cause", ("job_id", "cause")),
    MetricDef("unbroken_pause_seconds", "histogram", "training time a re-form paused the job (last step of one "
              "generation to the first of the next, less that step), by cause", ("job_id", "cause")),
    MetricDef("unbroken_dp_degree", "gauge", "data-parallel degree of the job now", ("job_id",)),
    MetricDef("unbroken_generation", "gauge", "generation of the job's worker group", ("job_id",)),
    MetricDef("unbroken_spares", "gauge", "warm spare replicas ready beside the job's group (resources.spares)",
              ("job_id",)),
    MetricDef("unbroken_store_write_failures", "gauge",
              "failed attempts of the job's supervisor to write the job store so far (each is retried)", ("job_id",)),
    MetricDef("unbroken_store_backlog", "gauge", "writes the supervisor holds for the job store, unwritten", ("job_id",)),
    MetricDef(MEMORY_METRIC, "gauge", MEMORY_METRIC_HELP, ("node",), recorded_by="checkpointing.keeper"),
)

BY_NAME: dict[str, MetricDef] = {m.name: m for m in METRICS}

# Names the control plane's own /metrics serves (prometheus_client in api/routers/metrics.py).
API_METRICS: tuple[str, ...] = (
    "unbroken_api_requests_total",
    "unbroken_api_request_seconds_bucket",
    "unbroken_api_request_seconds_sum",
    "unbroken_api_request_seconds_count",
    "unbroken_queue_length",
    "unbroken_jobs",
    "unbroken_job_info",
    "unbroken_job_step",
    "unbroken_job_dp",
    "unbroken_job_recoveries",
)


def exported_names() -> set[str]:
    """Every Prometheus series name the runtime's metrics appear under."""
    return {n for m in METRICS for n in m.exported}


_lock = threading.Lock()
_metrics: dict[str, Any] | None = None
_last_eval: dict[tuple[str, int], float] = {}  # (job, rank) -> the newest held-out loss


def _ray_ready() -> bool:
    try:
        import ray
    except ImportError:
        return False
    return bool(ray.is_initialized())


def _get() -> dict[str, Any] | None:
    """This process's Ray metric objects, made on first use; None where Ray is not connected."""
    global _metrics
    if _metrics is not None:
        return _metrics
    if not _ray_ready():
        return None
    from ray.util.metrics import Counter, Gauge, Histogram

    with _lock:
        if _metrics is None:
            made: dict[str, Any] = {}
            for m in (m for m in METRICS if m.recorded_by == __name__):
                if m.kind == "gauge":
                    made[m.name] = Gauge(m.name, description=m.description, tag_keys=m.tag_keys)
                elif m.kind == "counter":
                    made[m.name] = Counter(m.name, description=m.description, tag_keys=m.tag_keys)
                else:
                    made[m.name] = Histogram(m.name, description=m.description, boundaries=DURATION_BUCKETS_S,
                                             tag_keys=m.tag_keys)
            _metrics = made
    return _metrics


def _never_raises(fn: Callable[_P, None]) -> Callable[_P, None]:
    """Metrics are called from the training loop and checkpoint threads: a failing export is logged
    (once per function) and never stops training."""
    warned = False

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> None:
        nonlocal warned
        try:
            fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            if not warned:
                warned = True
                log.warning("metric %s not recorded: %s: %s", fn.__name__, type(e).__name__, e)

    return wrapper


def _tags(job_id: str, rank: int | None = None) -> dict[str, str]:
    tags = {"job_id": str(job_id)}
    if rank is not None:
        tags["rank"] = str(int(rank))
    return tags


@_never_raises
def record_step(job_id: str, rank: int, m: StepLike) -> None:
    """One completed step of one rank: step time, tokens/s, MFU (when known), loss. The job's dp and
    generation are the supervisor's to set (record_group), once per formation, not every rank every step."""
    ms = _get()
    if ms is None:
        return
    tags = _tags(job_id, rank)
    ms["unbroken_step_time_s"].set(float(m.step_time_s), tags=tags)
    ms["unbroken_tokens_per_s"].set(float(m.tokens_per_s), tags=tags)
    if m.mfu is not None:
        ms["unbroken_mfu"].set(float(m.mfu), tags=tags)
    ms["unbroken_loss"].set(float(m.loss), tags=tags)
    # Evaluations are every eval_every steps, but Ray drops a gauge not set again within ~20 s: the last
    # held-out loss is set again at every step.
    key = (str(job_id), int(rank))
    if getattr(m, "eval_loss", None) is not None:
        _last_eval[key] = float(m.eval_loss)
    if key in _last_eval:
        ms["unbroken_eval_loss"].set(_last_eval[key], tags=tags)
    ms["unbroken_step"].set(float(m.step), tags=tags)


@_never_raises
def record_snapshot(job_id: str, rank: int, seconds: float, nbytes: int) -> None:
    """One in-memory snapshot of one rank: how long it took and how many bytes it holds."""
    ms = _get()
    if ms is None:
        return
    tags = _tags(job_id, rank)
    ms["unbroken_snapshot_seconds"].observe(float(seconds), tags=tags)
    ms["unbroken_snapshot_bytes"].set(float(nbytes), tags=tags)


@_never_raises
def record_checkpoint(job_id: str, rank: int, seconds: float, nbytes: int) -> None:
    """One persistent checkpoint write of one rank (its shard): duration and bytes written."""
    ms = _get()
    if ms is None:
        return
    tags = _tags(job_id, rank)
    ms["unbroken_checkpoint_seconds"].observe(float(seconds), tags=tags)
    ms["unbroken_checkpoint_bytes"].set(float(nbytes), tags=tags)


@_never_raises
def record_recovery(job_id: str, cause: str) -> None:
    """One recovery of a job; cause is short and from a small set (e.g. actor_died, node_lost,
    heartbeat_timeout, collective_error, chaos) so the label stays low-cardinality."""
    ms = _get()
    if ms is None:
        return
    ms["unbroken_recoveries_total"].inc(1.0, tags={"job_id": str(job_id), "cause": str(cause)})


@_never_raises
def record_pause(job_id: str, cause: str, seconds: float) -> None:
    """One re-form's pause of training (service.supervisor.pauses); cause: a failure's kind, growth,
    scheduler or re-form, a small set."""
    ms = _get()
    if ms is None:
        return
    ms["unbroken_pause_seconds"].observe(float(seconds), tags={"job_id": str(job_id), "cause": str(cause)})


_spares: dict[str, int] = {}  # job -> warm spares last recorded (re-set with the group's shape)


@_never_raises
def record_group(job_id: str, dp: int, generation: int, spares: int | None = None) -> None:
    """The worker group's shape at each (re)formation: the one place dp degree, generation and warm spares
    are set. spares=None re-sets the last count recorded (0 for a job without spares)."""
    ms = _get()
    if ms is None:
        return
    job = _tags(job_id)
    if spares is not None:
        _spares[str(job_id)] = int(spares)
    ms["unbroken_dp_degree"].set(float(dp), tags=job)
    ms["unbroken_generation"].set(float(generation), tags=job)
    ms["unbroken_spares"].set(float(_spares.get(str(job_id), 0)), tags=job)


@_never_raises
def record_heartbeat_age(job_id: str, rank: int, age_s: float) -> None:
    """Seconds since the supervisor last heard from `rank` (the supervisor's watch loop)."""
    ms = _get()
    if ms is None:
        return
    ms["unbroken_heartbeat_age_s"].set(float(age_s), tags=_tags(job_id, rank))


@_never_raises
def record_store_writes(job_id: str, backlog: int, failures: int) -> None:
    """The supervisor's writes to the job store: how many it holds unwritten, and its failed attempts so
    far (a gauge set at every write, 0 while all is well: a counter would have no series until trouble)."""
    ms = _get()
    if ms is None:
        return
    job = _tags(job_id)
    ms["unbroken_store_backlog"].set(float(backlog), tags=job)
    ms["unbroken_store_write_failures"].set(float(failures), tags=job)
