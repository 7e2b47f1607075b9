"""Prometheus /metrics: request counts and latency (recorded by the app's middleware), the queue
length, jobs by status, and one series per unfinished job with its `job_id` (read from the store at
scrape time). One registry per app.

The per-job series are the control plane's view (what the store knows); the per-rank training
metrics come from the Ray nodes' own endpoints (workers/telemetry.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from api.deps import AppState, get_state
from service.store import JobStore

router = APIRouter(tags=["metrics"])


class StoreCollector(Collector):
    def __init__(self, store: JobStore) -> None:
        self.store = store

    def collect(self) -> Iterator[GaugeMetricFamily]:
        counts = self.store.count_by_status()
        by_status = GaugeMetricFamily("unbroken_jobs", "jobs in the store by status", labels=["status"])
        for status, n in counts.items():
            by_status.add_metric([status], n)
        yield by_status
        yield GaugeMetricFamily("unbroken_queue_length", "jobs waiting for admission", value=self.store.queue_length())
        info = GaugeMetricFamily("unbroken_job_info", "an unfinished job (always 1): its name, owner and status",
                                 labels=["job_id", "name", "owner", "status"])
        step = GaugeMetricFamily("unbroken_job_step", "last step the job reported", labels=["job_id"])
        dp = GaugeMetricFamily("unbroken_job_dp", "data-parallel degree the job last reported", labels=["job_id"])
        target = GaugeMetricFamily("unbroken_job_target_dp", "data-parallel degree the scheduler asked the job "
                                   "to run at", labels=["job_id"])
        recov = GaugeMetricFamily("unbroken_job_recoveries", "recoveries of the job so far", labels=["job_id"])
        for job in self.store.admitted_jobs():
            info.add_metric([job.id, job.name, job.owner, job.status], 1.0)
            progress = job.progress or {}
            if isinstance(progress.get("step"), int | float):
                step.add_metric([job.id], float(progress["step"]))
            if isinstance(progress.get("dp"), int | float):
                dp.add_metric([job.id], float(progress["dp"]))
            recov.add_metric([job.id], float(job.recoveries))
            if job.target_dp is not None:
                target.add_metric([job.id], float(job.target_dp))
        yield from (info, step, dp, target, recov)


class SchedulerCollector(Collector):
    """The scheduler's decisions by kind (admit, shrink, grow) since this process started."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def collect(self) -> Iterator[CounterMetricFamily]:
        fam = CounterMetricFamily("unbroken_scheduler_decisions", "scheduling decisions by kind (each also an "
                                  "event of the job, with its reason)", labels=["kind"])
        for kind in ("admit", "shrink", "grow"):
            fam.add_metric([kind], float(self.scheduler.decisions.get(kind, 0)))
        yield fam


class ApiMetrics:
    def __init__(self, store: JobStore, scheduler: Any | None = None) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "unbroken_api_requests", "HTTP requests answered", ["method", "route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "unbroken_api_request_seconds", "time to answer an HTTP request", ["method", "route"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.registry.register(StoreCollector(store))
        if scheduler is not None and hasattr(scheduler, "decisions"):
            self.registry.register(SchedulerCollector(scheduler))

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests.labels(method, route, str(status)).inc()
        self.latency.labels(method, route).observe(seconds)


@router.get("/metrics", summary="Prometheus metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}}})
def metrics(state: AppState = Depends(get_state)) -> Response:
    reg = state.extra["metrics"].registry
    return Response(generate_latest(reg), media_type=CONTENT_TYPE_LATEST)
