"""The API's Prometheus metrics: its own counters (requests, latency, tokens, requests in flight) and the engines'
state read at scrape time (readiness, queue, scheduler counters, memory)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..protocol import Response

log = logging.getLogger("clef_engine.server")

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# The engine scheduler's own counters (Engine.info()["scheduler"]): every batch of the process, the workbench's too.
SCHEDULER_METRICS = (
    ("batches", "clef_engine_batches_total", "counter", "Batches the GPU worker ran."),
    ("records", "clef_engine_batch_records_total", "counter", "Records in those batches; over batches: mean size."),
    ("tokens", "clef_engine_batch_tokens_total", "counter", "Tokens in those batches."),
    ("largest_batch_records", "clef_engine_batch_records_max", "gauge", "Most records in one batch so far."),
    ("last_batch_records", "clef_engine_batch_records_last", "gauge", "Records in the latest batch."),
    ("busy_seconds", "clef_engine_busy_seconds_total", "counter", "Time the GPU worker spent running batches."),
    ("busy", "clef_engine_busy", "gauge", "1 while the GPU worker runs a batch."),
    ("abandoned_batches", "clef_engine_abandoned_batches_total", "counter",
     "Batches stopped part-way because every request in them had passed its deadline."),
)


class Metrics:
    """The API's Prometheus metrics, in a registry of their own: two apps in one process (the workbench's and a
    test's) never share or double-register counters. The engine's numbers are read at scrape time."""

    def __init__(self, models_or_none: Callable[[], dict[str, Any] | None]):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("clef_api_requests", "HTTP requests answered, by path and status.",
                                ["path", "status"], registry=registry)
        self.latency = Histogram("clef_api_request_duration_seconds", "Time to answer POST /v1/systemone, any status.",
                                 buckets=LATENCY_BUCKETS, registry=registry)
        self.input_tokens = Counter("clef_api_input_tokens", "Input tokens of answered requests.", registry=registry)
        self.decisions = Counter("clef_api_decisions", "Questions answered.", registry=registry)
        self.truncated_state_tokens = Counter("clef_api_truncated_state_tokens",
                                              "State tokens cut on requests that opted in to truncation.",
                                              registry=registry)
        self.in_flight = Gauge("clef_api_requests_in_flight", "Requests waiting for the engine now.",
                               registry=registry)
        self.max_in_flight = Gauge("clef_api_requests_in_flight_max", "Most requests waiting for the engine at once.",
                                   registry=registry)
        self._in_flight_lock = threading.Lock()  # the maximum is read-modify-write; a gauge alone cannot keep it
        self._in_flight_now = 0
        self._in_flight_most = 0
        self._models_or_none = models_or_none
        registry.register(self)  # as a collector: `collect` reads the engines at scrape time

    def count_request(self, path: str, status: int) -> None:
        self.requests.labels(path=path, status=str(status)).inc()

    def count_answer(self, response: Response) -> None:
        self.input_tokens.inc(int(response["usage"].get("input_tokens") or 0))
        self.decisions.inc(len(response["answers"]))
        self.truncated_state_tokens.inc(int(response.get("x_truncated_state_tokens") or 0))

    def enter(self) -> None:
        with self._in_flight_lock:
            self._in_flight_now += 1
            self.in_flight.set(self._in_flight_now)
            self._in_flight_most = max(self._in_flight_most, self._in_flight_now)
            self.max_in_flight.set(self._in_flight_most)

    def leave(self) -> None:
        with self._in_flight_lock:
            self._in_flight_now -= 1
            self.in_flight.set(self._in_flight_now)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        """The engines' state: readiness; per resident model (label `model`) its queue, the scheduler's counters
        and the memory its weights took; the device's memory once (read through the default model)."""
        models = self._models_or_none() or {}
        yield GaugeMetricFamily("clef_engine_ready", "1 when a model is loaded and answering.",
                                value=1 if models else 0)
        queue = GaugeMetricFamily("clef_engine_queue_depth", "Requests waiting for the GPU worker.", labels=["model"])
        scheduler_families = [(key, (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
            name, help_text, labels=["model"])) for key, name, kind, help_text in SCHEDULER_METRICS]
        weights = GaugeMetricFamily("clef_engine_weights_bytes", "Accelerator memory the model took when it was "
                                    "loaded (0 on CPU).", labels=["model"])
        device_memory = None
        for name, engine in models.items():
            info = safe_call(engine.info, default={})
            queue.add_metric([name], safe_call(engine.queue_depth, default=0))
            scheduler = info.get("scheduler") or {}
            for key, family in scheduler_families:
                value = scheduler.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    family.add_metric([name], value)
            memory = {k: v for k, v in (info.get("memory") or {}).items() if isinstance(v, (int, float))}
            weights.add_metric([name], memory.get("loaded", 0))
            if device_memory is None:  # the default model's view: allocations are counted per device, not model
                device_memory = memory
        yield queue
        for _, family in scheduler_families:
            yield family
        yield weights
        memory = {"loaded": 0, "allocated": 0, "peak_allocated": 0, "peak_reserved": 0}
        memory.update(device_memory or {})
        family = GaugeMetricFamily("clef_engine_memory_bytes", "Accelerator memory: the default model's weights "
                                   "when loaded, allocated now, peak allocated, peak reserved (0 on CPU).",
                                   labels=["kind"])
        for kind, value in sorted(memory.items()):
            family.add_metric([kind], value)
        yield family


def safe_call(fn: Callable[[], Any], default: Any) -> Any:
    try:
        return fn()
    except Exception:  # a metrics scrape must not fail because the engine is busy or gone
        log.exception("metrics: %s failed", getattr(fn, "__name__", fn))
        return default

