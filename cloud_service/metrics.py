"""Prometheus metrics of one server, in a registry of its own (two servers in one process never mix).

Exposed names (all prefixed `tierkit_`):

| metric | labels | meaning |
| --- | --- | --- |
| `requests_total` | model, protocol | inference requests received |
| `request_failures_total` | model, protocol, code | requests answered with an error, by gRPC status name |
| `request_latency_seconds` | model, protocol | receipt to answer |
| `refusal_seconds` | model, protocol, stage | receipt to refusal (RESOURCE_EXHAUSTED or UNAVAILABLE): `admission` |
| | | (refused on receipt: must come at once) or `queued` (admitted, queued, then shed as hopeless) |
| `batch_size` | model | rows per executed batch |
| `batch_run_seconds` | model | run time of one batch |
| `queue_depth` | model | requests waiting |
| `requests_expired_total` | model | queued requests dropped before compute: deadline passed or no longer reachable |
| `requests_refused_total` | model, reason | refused at admission: `deadline`, `queue_full`, `standing`, `waiting`, |
| | | `ignored_hint` (gRPC: the caller called again inside its last refusal's retry hint, `callers.py`) |
| `queue_seconds` | model | time each request waited in the queue (to run, or to be dropped) |
| `answers_dropped_total` | model, protocol | answers computed after the caller's deadline, dropped before send |
| `mqtt_garbage_total` | | MQTT payloads that were not a valid request |
| `mqtt_duplicates_total` | | MQTT requests answered from the duplicate cache |
| `model_loads_total` | model, outcome | loads and hot swaps: `loaded` or `refused` |
| `refusals_total` | surface, reason | hostile or malformed input refused, by where and why |
| `models_ready` | | models being served |

Requests for unknown models are labelled `model="_unknown"`, so a client cannot grow the label set.
"""

from __future__ import annotations

import logging
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

log = logging.getLogger(__name__)

UNKNOWN_MODEL = "_unknown"
_REFUSALS = ("RESOURCE_EXHAUSTED", "UNAVAILABLE")
_LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Metrics:
    """The server's counters, gauges and histograms.

    Example:
        >>> metrics = Metrics()
        >>> host, port = metrics.serve("127.0.0.1", 0)
        >>> metrics.request_done("digits", "grpc", 0.002, code=None)
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("tierkit_requests", "Inference requests received.", ["model", "protocol"], registry=r)
        self.failures = Counter("tierkit_request_failures", "Requests answered with an error, by status code.",
                                ["model", "protocol", "code"], registry=r)
        self.latency = Histogram("tierkit_request_latency_seconds", "Receipt to answer.", ["model", "protocol"],
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.refusal_seconds = Histogram("tierkit_refusal_seconds",
                                         "Receipt to refusal (RESOURCE_EXHAUSTED, UNAVAILABLE) of refused requests.",
                                         ["model", "protocol", "stage"], buckets=_LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("tierkit_batch_size", "Rows per executed batch.", ["model"],
                                    buckets=_BATCH_BUCKETS, registry=r)
        self.batch_seconds = Histogram("tierkit_batch_run_seconds", "Run time of one batch.", ["model"],
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("tierkit_queue_depth", "Requests waiting in the model's queue.", ["model"],
                                 registry=r)
        self.expired = Counter("tierkit_requests_expired", "Requests dropped for their deadline before compute.",
                               ["model"], registry=r)
        self.answers_dropped = Counter("tierkit_answers_dropped",
                                       "Answers ready after the caller's deadline, dropped before send.",
                                       ["model", "protocol"], registry=r)
        self.admission_refused = Counter("tierkit_requests_refused",
                                         "Requests refused at admission (RESOURCE_EXHAUSTED at once), by reason.",
                                         ["model", "reason"], registry=r)
        self.queue_seconds = Histogram("tierkit_queue_seconds", "Time a request waited in the model's queue.",
                                       ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.mqtt_garbage = Counter("tierkit_mqtt_garbage", "MQTT payloads that were not a valid request.",
                                    registry=r)
        self.mqtt_duplicates = Counter("tierkit_mqtt_duplicates", "MQTT requests answered from the duplicate cache.",
                                       registry=r)
        self.model_loads = Counter("tierkit_model_loads", "Model loads and hot swaps.", ["model", "outcome"],
                                   registry=r)
        self.refusals = Counter("tierkit_refusals", "Hostile or malformed input refused, by where and why.",
                                ["surface", "reason"], registry=r)
        self.models_ready = Gauge("tierkit_models_ready", "Models being served.", registry=r)
        self._http: WSGIServer | None = None
        self._children: dict[tuple[str, str], tuple[Any, Any]] = {}

    def request_done(self, model: str, protocol: str, seconds: float, *, code: str | None,
                     shed: bool = False) -> None:
        """Count one answered request; `code` is the gRPC status name of a failure, None on success; `shed`: a
        refusal of a request that was admitted and queued first (timed apart from refusals at admission)."""
        children = self._children.get((model, protocol))
        if children is None:  # labels() takes a lock and builds a key: do it once per (model, protocol)
            children = self.requests.labels(model, protocol), self.latency.labels(model, protocol)
            self._children[model, protocol] = children
        children[0].inc()
        children[1].observe(seconds)
        if code is not None:
            self.failures.labels(model, protocol, code).inc()
            if code in _REFUSALS:
                self.refusal_seconds.labels(model, protocol, "queued" if shed else "admission").observe(seconds)

    def hint_ignored(self, model: str) -> None:
        """Count one call refused because its caller called again inside its retry hint."""
        self.admission_refused.labels(model, "ignored_hint").inc()

    def answer_dropped(self, model: str, protocol: str) -> None:
        """Count one answer dropped before send: its caller's deadline had passed."""
        self.answers_dropped.labels(model, protocol).inc()

    def refused(self, surface: str, reason: str) -> None:
        """Count one refusal; `reason` is one of a fixed set per surface, never request content."""
        self.refusals.labels(surface, reason).inc()

    def observer(self, model: str) -> ModelObserver:
        return ModelObserver(self, model)

    def render(self) -> bytes:
        """The exposition text, as the endpoint serves it."""
        return generate_latest(self.registry)

    def serve(self, host: str, port: int) -> tuple[str, int]:
        """Serve `/metrics` over HTTP in a daemon thread; return the bound address."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        bound = server.server_address
        return str(bound[0]), int(bound[1])

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class ModelObserver:
    """The batcher's observer for one model (see `batcher.BatchObserver`)."""

    def __init__(self, metrics: Metrics, model: str) -> None:
        self._model = model
        self._refused = metrics.admission_refused
        self._queue_seconds = metrics.queue_seconds.labels(model)
        self._depth = metrics.queue_depth.labels(model)
        self._size = metrics.batch_size.labels(model)
        self._seconds = metrics.batch_seconds.labels(model)
        self._expired = metrics.expired.labels(model)

    def on_queue(self, depth: int) -> None:
        self._depth.set(depth)

    def on_batch(self, rows: int, requests: int, seconds: float, queued: float) -> None:
        self._size.observe(rows)
        self._seconds.observe(seconds)

    def on_expired(self, count: int) -> None:
        self._expired.inc(count)

    def on_refused(self, reason: str) -> None:
        self._refused.labels(self._model, reason).inc()

    def on_queue_time(self, seconds: float) -> None:
        self._queue_seconds.observe(seconds)
