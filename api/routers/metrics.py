"""Prometheus /metrics: request counts and latency (recorded by the app's middleware), the queue
length and jobs by status (read from the store at scrape time). One registry per app."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
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


class ApiMetrics:
    def __init__(self, store: JobStore) -> None:
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

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests.labels(method, route, str(status)).inc()
        self.latency.labels(method, route).observe(seconds)


@router.get("/metrics", summary="Prometheus metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}}})
def metrics(state: AppState = Depends(get_state)) -> Response:
    reg = state.extra["metrics"].registry
    return Response(generate_latest(reg), media_type=CONTENT_TYPE_LATEST)
