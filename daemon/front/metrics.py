"""The front door's Prometheus metrics, served at ``/metrics`` on its port: requests, queue wait,
load time, loads, unloads and crashes per model, and each model's state and requests now."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from vqpool.daemon.front.model_slot import ModelSlot

STATES = ("not_loaded", "waiting_for_memory", "loading", "loaded", "unloading")
_WAIT_BUCKETS = (0.001, 0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
_LOAD_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)


class _SlotCollector(Collector):
    """Each model's state, running and queued requests, read at scrape time."""

    def __init__(self) -> None:
        self.slots: Mapping[str, ModelSlot] = {}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        state = GaugeMetricFamily(
            "vqpool_front_model_state",
            "1 for the state each model is in.",
            labels=["model", "state"],
        )
        running = GaugeMetricFamily(
            "vqpool_front_running_requests", "Requests proxied now.", labels=["model"]
        )
        queued = GaugeMetricFamily(
            "vqpool_front_queued_requests",
            "Requests waiting for their model to load.",
            labels=["model"],
        )
        for name, slot in self.slots.items():
            for each in STATES:
                state.add_metric([name, each], float(slot.state == each))
            running.add_metric([name], slot.running)
            queued.add_metric([name], slot.queued)
        yield state
        yield running
        yield queued


class FrontMetrics:
    """Counters the supervisor and the HTTP handlers update."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._slots = _SlotCollector()
        self.registry.register(self._slots)
        self._requests = Counter(
            "vqpool_front_requests",
            "Completion requests answered, by model and HTTP status.",
            ["model", "status"],
            registry=self.registry,
        )
        self._queue_wait = Histogram(
            "vqpool_front_queue_wait_seconds",
            "Seconds requests waited for their model to load.",
            ["model"],
            buckets=_WAIT_BUCKETS,
            registry=self.registry,
        )
        self._load_time = Histogram(
            "vqpool_front_load_seconds",
            "Seconds from starting a model's worker to its serving.",
            ["model"],
            buckets=_LOAD_BUCKETS,
            registry=self.registry,
        )
        self._load_failures = Counter(
            "vqpool_front_load_failures",
            "Loads that failed.",
            ["model"],
            registry=self.registry,
        )
        self._unloads = Counter(
            "vqpool_front_unloads",
            "Unloads by reason: idle, room, operator, shutdown.",
            ["model", "reason"],
            registry=self.registry,
        )
        self._crashes = Counter(
            "vqpool_front_worker_crashes",
            "Workers that exited while their model was loaded.",
            ["model"],
            registry=self.registry,
        )

    def watch(self, slots: Mapping[str, ModelSlot]) -> None:
        self._slots.slots = slots

    def request(self, model: str, status: int) -> None:
        self._requests.labels(model, str(status)).inc()

    def queue_wait(self, model: str, seconds: float) -> None:
        self._queue_wait.labels(model).observe(seconds)

    def loaded(self, model: str, seconds: float) -> None:
        self._load_time.labels(model).observe(seconds)

    def load_failed(self, model: str) -> None:
        self._load_failures.labels(model).inc()

    def unloaded(self, model: str, reason: str) -> None:
        self._unloads.labels(model, reason).inc()

    def crashed(self, model: str) -> None:
        self._crashes.labels(model).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
