"""The server's Prometheus metrics, in a registry of its own (several apps in one process, as in
tests, must not share the process-wide default registry)."""
from __future__ import annotations

from typing import Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "bertdist_serve"
# Request latency and queue wait: from a millisecond (a tiny model, no wait) to a request that
# queued behind a full queue of long texts.
SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class ServeMetrics:
    """Request counts and latency (by model, route, status code), batch sizes, queue waits,
    batch run times, queue depth and requests in flight."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "Requests to the model routes, by model, route and HTTP status code",
                                ["model", "route", "code"], registry=r)
        self.request_seconds = Histogram(f"{PREFIX}_request_duration_seconds",
                                         "Time from a request's arrival to its answer", ["model", "route"],
                                         buckets=SECONDS, registry=r)
        self.batch_size = Histogram(f"{PREFIX}_batch_size", "Items per model run", ["model"], buckets=BATCH_SIZES,
                                    registry=r)
        self.queue_seconds = Histogram(f"{PREFIX}_queue_wait_seconds",
                                       "Time an item waited in the queue before its batch ran", ["model"],
                                       buckets=SECONDS, registry=r)
        self.inference_seconds = Histogram(f"{PREFIX}_inference_duration_seconds", "Time of one model run (a batch)",
                                           ["model"], buckets=SECONDS, registry=r)
        self.queue_depth = Gauge(f"{PREFIX}_queue_depth", "Items waiting for a batch", ["model"], registry=r)
        self.abandoned = Counter(f"{PREFIX}_abandoned_items",
                                 "Queued items taken off the queue unrun because their client left", ["model"],
                                 registry=r)
        self.in_flight = Gauge(f"{PREFIX}_requests_in_flight", "Requests being answered", ["model"], registry=r)
        self._children: dict[tuple, object] = {}

    def child(self, metric, *labels: str):
        """``metric.labels(*labels)``, looked up once: several are touched per request. The label
        values come from fixed sets (loaded models, routes, status codes), so the cache stays small."""
        key = (id(metric), labels)
        got = self._children.get(key)
        if got is None:
            got = self._children[key] = metric.labels(*labels)
        return got

    def add_model(self, model: str) -> None:
        """Makes the per-model series exist (at 0) before the first request."""
        self.queue_depth.labels(model).set(0)
        self.in_flight.labels(model).set(0)
        self.abandoned.labels(model)

    # bertdist.serve.batcher.Observer
    def observe_batch(self, model: str, size: int, queue_waits: Sequence[float], run_seconds: float) -> None:
        self.child(self.batch_size, model).observe(size)
        self.child(self.inference_seconds, model).observe(run_seconds)
        waits = self.child(self.queue_seconds, model)
        for w in queue_waits:
            waits.observe(w)

    def observe_abandoned(self, model: str, items: int) -> None:
        self.child(self.abandoned, model).inc(items)

    def set_queue_depth(self, model: str, items: int) -> None:
        self.child(self.queue_depth, model).set(items)

    def observe_request(self, model: str, route: str, code: int, seconds: float) -> None:
        self.child(self.requests, model, route, str(code)).inc()
        self.child(self.request_seconds, model, route).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
