"""Prometheus metrics over HTTP for vqpoold (``--metrics-port``; off by default).

Two threads meet here, and never on the allocator:

* The daemon loop (one thread) counts each request: one dict increment for (socket, op, code),
  one bucket increment of a latency histogram, one ``perf_counter`` pair. Nothing else happens
  per request; pool gauges are not maintained at all between scrapes.
* prometheus_client's HTTP server answers scrapes in its own threads. A scrape does not read the
  allocator or the sessions (the loop may be in the middle of changing them): it asks the loop
  for a snapshot, wakes it through its self-pipe, and waits (at most a second) until the loop,
  between two requests, has published an immutable :class:`MetricsSnapshot`. The collector
  turns that snapshot into metric families.

Metric names: VeloxQuant's ``veloxquant_block_pool_*`` series exactly as
``AllocationStats.to_prometheus`` writes them (read back from that text, so the names have one
source), plus ``vqpool_*`` series for streams, models, sessions and requests.
"""

from __future__ import annotations

import logging
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from vqpool.daemon.core.views import priced_holdings
from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.errors import ErrorCode
from vqpool.shared.protocol import ADMIN_OPS, PROMPT_CACHE_FIGURES, WORKER_OPS
from vqpool.shared.stats import AllocationStats

log = logging.getLogger("vqpoold")

METRICS_ADDRESS = "127.0.0.1"
"""Metrics are served on loopback only: they name models and pids."""

REQUEST_SECONDS_BUCKETS: tuple[float, ...] = (
    25e-6,
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    100e-3,
    1.0,
)
"""Upper bounds of the request handling time histogram. Handling an allocate takes a few us,
so the low end is fine-grained; anything past 10 ms is an incident."""

SNAPSHOT_WAIT_SECONDS = 1.0
"""How long a scrape waits for the loop to publish a fresh snapshot before serving the last."""

_KNOWN_OPS = WORKER_OPS | ADMIN_OPS
_CODE_NAMES = {0: "OK", **{int(code): code.name for code in ErrorCode}}

_SEED_HELP = {
    "veloxquant_block_pool_blocks_in_use": "Blocks allocated now.",
    "veloxquant_block_pool_blocks_total": "Blocks the pool manages now.",
    "veloxquant_block_pool_fragmentation": "Fraction of blocks allocated but not full.",
    "veloxquant_block_pool_peak_blocks_in_use": "High-water mark of blocks allocated at once.",
    "veloxquant_block_pool_allocations": "Blocks handed out.",
    "veloxquant_block_pool_frees": "Blocks returned.",
    "veloxquant_block_pool_reused": "Allocated blocks that had been handed out before.",
    "veloxquant_block_pool_exhausted": "Allocations refused for want of free blocks.",
    "veloxquant_block_pool_grown": "Blocks added by growth on exhaustion.",
    "veloxquant_block_pool_retired": "Blocks retired for good by shrink.",
}


class InstrumentedHandler(Protocol):
    """A request handler that says which op and which outcome its last request had."""

    last_op: str
    last_code: int

    def handle(self, payload: bytes, peer: bytes, now: float) -> Any: ...


class RequestMetrics:
    """Request counters and handling-time histograms; touched by the loop thread only.

    Kept per socket and op as one histogram row (bucket counts, then the sum of seconds), plus
    a count per (op, error code) for failed requests only: a successful request costs one dict
    lookup by op name and two list increments, with no tuple built. Requests by outcome are
    derived at scrape time (OK = all requests of the op minus its errors).
    """

    def __init__(self) -> None:
        # socket -> op -> per-bucket counts (the last bucket is +Inf), then the sum of seconds
        self.seconds: dict[str, dict[str, list[float]]] = {}
        # socket -> (op, error code) -> failed requests
        self.errors: dict[str, dict[tuple[str, int], int]] = {}

    def instrument(
        self, socket_name: str, handler: InstrumentedHandler
    ) -> Callable[[bytes, bytes, float], Any]:
        """``handler.handle`` wrapped to count and time each request."""
        handle = handler.handle
        ops = self.seconds.setdefault(socket_name, {})
        errors = self.errors.setdefault(socket_name, {})
        perf_counter = time.perf_counter
        bounds = REQUEST_SECONDS_BUCKETS
        n_slots = len(bounds) + 2

        def counted(payload: bytes, peer: bytes, now: float) -> Any:
            started = perf_counter()
            reply = handle(payload, peer, now)
            elapsed = perf_counter() - started
            op = handler.last_op
            row = ops.get(op)
            if row is None:
                if op not in _KNOWN_OPS:  # the label set must not grow with what peers send
                    op = "unknown"
                row = ops.get(op)
                if row is None:
                    row = ops[op] = [0.0] * n_slots
            row[bisect_left(bounds, elapsed)] += 1
            row[-1] += elapsed
            code = handler.last_code
            if code:
                key = (op, code)
                errors[key] = errors.get(key, 0) + 1
            return reply

        return counted

    def counts(self) -> dict[tuple[str, str, int], int]:
        """Requests by (socket, op, outcome code; 0 for OK)."""
        counts: dict[tuple[str, str, int], int] = {}
        for socket_name, ops in self.seconds.items():
            errors = self.errors[socket_name]
            for op, row in ops.items():
                n_failed = sum(n for (failed_op, _), n in errors.items() if failed_op == op)
                n_ok = int(sum(row[:-1])) - n_failed
                if n_ok:
                    counts[(socket_name, op, 0)] = n_ok
            for (op, code), n in errors.items():
                counts[(socket_name, op, code)] = n
        return counts

    def histograms(self) -> dict[tuple[str, str], tuple[float, ...]]:
        """Handling-time rows by (socket, op), copied."""
        return {
            (socket_name, op): tuple(row)
            for socket_name, ops in self.seconds.items()
            for op, row in ops.items()
        }


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """Everything a scrape shows, copied by the loop thread at one instant."""

    stats: AllocationStats
    streams: dict[str, tuple[int, int]]  # stream -> (free, total)
    held: dict[tuple[str, str], tuple[int, int]]  # (model, stream) -> (blocks, bytes)
    sessions: int
    owners: int
    sessions_opened: int
    sessions_reaped: int
    sessions_evicted: int
    bad_requests: int
    replies_dropped: int
    requests: dict[tuple[str, str, int], int]
    seconds: dict[tuple[str, str], tuple[float, ...]]
    uptime: float
    version: str
    boot_id: str
    budget: dict[str, Any]  # the budget admin op's view
    models: list[dict[str, Any]]  # the model_list op's views
    prompt_caches: dict[str, dict[str, int]]  # model -> its workers' prompt-cache reports, summed

    @classmethod
    def take(cls, state: DaemonState, requests: RequestMetrics, version: str) -> MetricsSnapshot:
        """The daemon's state now. Loop thread only; O(allocations held), paid once per scrape."""
        coord = state.coord
        allocator = coord.allocator
        now = time.monotonic()
        held: dict[tuple[str, str], tuple[int, int]] = {}
        caches: dict[str, dict[str, int]] = {}
        for session in coord.sessions:
            if session.prompt_cache is not None:
                total = caches.setdefault(session.model, dict.fromkeys(session.prompt_cache, 0))
                for name, n in session.prompt_cache.items():
                    total[name] += n
            for usage in coord.usage_by(session).values():
                for stream, (n_held, _) in usage.items():
                    key = (session.model, stream)
                    n_blocks, n_bytes = held.get(key, (0, 0))
                    held[key] = (n_blocks + n_held, n_bytes)
            for stream, n_bytes in priced_holdings(coord, session)[0].items():
                key = (session.model, stream)
                n_blocks, before = held.get(key, (0, 0))
                held[key] = (n_blocks, before + n_bytes)
        return cls(
            stats=allocator.stats.snapshot(),
            streams={s: (allocator.n_free(s), allocator.n_total(s)) for s in allocator.streams},
            held=held,
            sessions=len(coord.sessions),
            owners=len(allocator.active_owners()),
            sessions_opened=coord.n_sessions_opened,
            sessions_reaped=coord.n_sessions_reaped,
            sessions_evicted=coord.n_sessions_evicted,
            bad_requests=coord.n_bad_requests,
            replies_dropped=coord.n_replies_dropped,
            requests=requests.counts(),
            seconds=requests.histograms(),
            uptime=coord.uptime(),
            version=version,
            boot_id=coord.boot_id,
            budget=state.budget.view(now),
            models=state.budget.model_views(now),
            prompt_caches=caches,
        )


def _seed_families(stats: AllocationStats) -> Iterator[Metric]:
    """The seed's pool metrics, parsed back from the seed's own text (one source of names)."""
    for family in text_string_to_metric_families(stats.to_prometheus()):
        family.documentation = _SEED_HELP.get(family.name, family.documentation)
        yield family


def metric_families(snap: MetricsSnapshot) -> Iterator[Metric]:
    """Every metric family of one snapshot."""
    yield from _seed_families(snap.stats)

    info = GaugeMetricFamily(
        "vqpool_daemon_info", "This vqpoold lifetime.", labels=["version", "boot_id"]
    )
    info.add_metric([snap.version, snap.boot_id], 1)
    yield info
    yield GaugeMetricFamily("vqpool_uptime_seconds", "Seconds since vqpoold started.", snap.uptime)

    per_stream = {
        "vqpool_stream_blocks": ("Blocks a stream manages now.", 1),
        "vqpool_stream_blocks_free": ("Free blocks of a stream.", 0),
    }
    for name, (doc, index) in per_stream.items():
        family = GaugeMetricFamily(name, doc, labels=["stream"])
        for stream, counts in snap.streams.items():
            family.add_metric([stream], counts[index])
        yield family
    in_use = GaugeMetricFamily(
        "vqpool_stream_blocks_in_use", "Blocks of a stream held by workers.", labels=["stream"]
    )
    for stream, (n_free, n_total) in snap.streams.items():
        in_use.add_metric([stream], n_total - n_free)
    yield in_use

    blocks = GaugeMetricFamily(
        "vqpool_model_blocks_held",
        "Blocks held by the workers serving a model, per stream.",
        labels=["model", "stream"],
    )
    bytes_held = GaugeMetricFamily(
        "vqpool_model_bytes_held",
        "Bytes of KV cache those blocks are in the workers (as the workers declared per block).",
        labels=["model", "stream"],
    )
    for (model, stream), (n_blocks, n_bytes) in sorted(snap.held.items()):
        blocks.add_metric([model, stream], n_blocks)
        bytes_held.add_metric([model, stream], n_bytes)
    yield blocks
    yield bytes_held

    kv_blocks = GaugeMetricFamily(
        "vqpool_model_kv_blocks",
        "Blocks held by the workers serving a model, per block format (fp16, bf16, q8g64, ...).",
        labels=["model", "format"],
    )
    kv_bytes = GaugeMetricFamily(
        "vqpool_model_kv_bytes",
        "Bytes of KV cache those blocks are in the workers, per block format (each block at "
        "its format's bytes, as the budget charges it).",
        labels=["model", "format"],
    )
    for view in snap.models:
        for fmt, held in view["formats"].items():
            kv_blocks.add_metric([view["model"], fmt], held["blocks"])
            kv_bytes.add_metric([view["model"], fmt], held["bytes"])
    yield kv_blocks
    yield kv_bytes

    yield from _budget_families(snap)
    yield from _prompt_cache_families(snap)
    yield from _memory_families(snap)

    yield GaugeMetricFamily("vqpool_sessions", "Live worker sessions.", snap.sessions)
    yield GaugeMetricFamily("vqpool_owners", "Active owner ids.", snap.owners)
    counters = (
        ("vqpool_sessions_opened", "Worker sessions opened by hello.", snap.sessions_opened),
        (
            "vqpool_sessions_reaped",
            "Sessions ended because the worker exited or stayed stopped past its lease.",
            snap.sessions_reaped,
        ),
        ("vqpool_sessions_evicted", "Sessions ended by an admin eviction.", snap.sessions_evicted),
        ("vqpool_bad_requests", "Requests refused as malformed.", snap.bad_requests),
        (
            "vqpool_replies_dropped",
            "Replies dropped because the peer's queue was full or it was gone.",
            snap.replies_dropped,
        ),
    )
    for name, doc, value in counters:
        yield CounterMetricFamily(name, doc, value)

    requests = CounterMetricFamily(
        "vqpool_requests",
        "Requests handled, by socket, op and outcome (OK or the error code's name).",
        labels=["socket", "op", "code"],
    )
    for (socket_name, op, code), count in sorted(snap.requests.items()):
        requests.add_metric([socket_name, op, _CODE_NAMES.get(code, str(code))], count)
    yield requests

    seconds = HistogramMetricFamily(
        "vqpool_request_seconds",
        "Time to handle one request in the daemon (decode, apply, encode; no network).",
        labels=["socket", "op"],
    )
    for (socket_name, op), row in sorted(snap.seconds.items()):
        cumulative = 0.0
        buckets: list[tuple[str, float]] = []
        bounds = [*map(str, REQUEST_SECONDS_BUCKETS), "+Inf"]
        for bound, n_in_bucket in zip(bounds, row[:-1], strict=True):
            cumulative += n_in_bucket
            buckets.append((bound, cumulative))
        seconds.add_metric([socket_name, op], buckets, row[-1])
    yield seconds


_MODEL_GAUGES = (
    (
        "vqpool_model_weights_bytes",
        "weights",
        "Bytes of a model's weights charged to the budget beside its KV (what its workers "
        "declared at hello and measure in their heartbeats, and pending load reservations).",
    ),
    ("vqpool_model_reserve_bytes", "reserve", "Bytes of the budget kept for a model."),
    (
        "vqpool_model_limit_bytes",
        "effective_limit",
        "Most bytes a model may hold (its limit, or the budget if smaller; absent if neither).",
    ),
    ("vqpool_model_weight", "weight", "A model's weight in sharing spare bytes."),
    (
        "vqpool_model_borrowed_bytes",
        "borrowed",
        "Bytes a model holds above its reserve (what reclaim may ask back).",
    ),
    (
        "vqpool_model_waiting_requests",
        "waiting",
        "Allocations of a model waiting at the daemon for memory.",
    ),
    ("vqpool_model_waiting_bytes", "waiting_bytes", "Bytes those waiting allocations ask for."),
    (
        "vqpool_model_lent_bytes",
        "lent",
        "Bytes of a model's unused reserve that other models hold on loan (--lend-reserves).",
    ),
)


def _prompt_cache_families(snap: MetricsSnapshot) -> Iterator[Metric]:
    """Per model, the prompt caches of its live workers as they last reported them (counters
    restart with a worker)."""
    for figure in PROMPT_CACHE_FIGURES:
        kind = CounterMetricFamily if figure.running_count else GaugeMetricFamily
        family = kind(f"vqpool_model_prompt_cache_{figure.name}", figure.help, labels=["model"])
        for model, cache in sorted(snap.prompt_caches.items()):
            family.add_metric([model], cache[figure.name])
        yield family


def _memory_families(snap: MetricsSnapshot) -> Iterator[Metric]:
    """Per model, what its workers' processes hold as they last reported it, beside what is
    declared for it (models with no report are absent)."""
    kinds = GaugeMetricFamily(
        "vqpool_model_measured_bytes",
        "Memory a model's worker processes hold, measured, by kind: mlx_active, mlx_cache, "
        "mlx_peak, rss, and total (mlx_active + mlx_cache, or rss where MLX reports none).",
        labels=["model", "kind"],
    )
    declared = GaugeMetricFamily(
        "vqpool_model_declared_bytes",
        "Memory declared for a model: the KV bytes its sessions hold plus its weights.",
        labels=["model"],
    )
    drift = GaugeMetricFamily(
        "vqpool_model_memory_drift",
        "1 when a model's measured total and declared bytes differ by more than the margin "
        "(25% of declared, at least 128 MiB), else 0.",
        labels=["model"],
    )
    for view in snap.models:
        memory = view.get("memory")
        if memory is None:
            continue
        model = view["model"]
        for kind in ("mlx_active", "mlx_cache", "mlx_peak", "rss"):
            kinds.add_metric([model, kind], memory[kind])
        kinds.add_metric([model, "total"], memory["measured"])
        declared.add_metric([model], memory["declared"])
        drift.add_metric([model], 1 if memory["drift"] else 0)
    yield from (kinds, declared, drift)


def _budget_families(snap: MetricsSnapshot) -> Iterator[Metric]:
    """The memory budget (absent without one) and each model's settings and demand. Bytes held
    per model are ``vqpool_model_bytes_held`` (by stream) above."""
    budget = snap.budget
    if budget["budget"] is not None:
        yield GaugeMetricFamily(
            "vqpool_budget_bytes", "Bytes all models may hold together.", budget["budget"]
        )
        yield GaugeMetricFamily(
            "vqpool_budget_free_bytes",
            "Bytes of the budget not held (budget - weights - KV held).",
            budget["free"],
        )
    yield GaugeMetricFamily(
        "vqpool_budget_weights_bytes",
        "Bytes of weights charged to the budget, all models together.",
        budget["total_weights"],
    )
    for name, key, doc in _MODEL_GAUGES:
        family = GaugeMetricFamily(name, doc, labels=["model"])
        for view in snap.models:
            if view.get(key) is not None:
                family.add_metric([view["model"]], view[key])
        yield family
    yield from _reclaim_families(budget["reclaim"])


def _reclaim_families(reclaim: dict[str, Any]) -> Iterator[Metric]:
    """Cooperative reclaim: asks by outcome, bytes, answer latency, workers' preemptions."""
    asks = CounterMetricFamily(
        "vqpool_reclaim_asks",
        "Asks to workers to give bytes back: asked, answered, late (deadline passed unanswered).",
        labels=["outcome"],
    )
    for outcome in ("asked", "answered", "late"):
        asks.add_metric([outcome], reclaim[outcome])
    yield asks
    yield CounterMetricFamily(
        "vqpool_reclaim_bytes",
        "Bytes given back to reclaim asks, by the daemon's ledger.",
        reclaim["bytes_reclaimed"],
    )
    latency = GaugeMetricFamily(
        "vqpool_reclaim_latency_seconds",
        "Seconds from an ask to its answer, over the last 1024 answers.",
        labels=["quantile"],
    )
    for quantile, key in (("0.5", "latency_p50_s"), ("0.99", "latency_p99_s")):
        if reclaim[key] is not None:
            latency.add_metric([quantile], reclaim[key])
    yield latency
    yield CounterMetricFamily(
        "vqpool_preemptions",
        "Requests the workers preempted (as they report them), to give memory back or to grow.",
        reclaim["preemptions"],
    )


class _SnapshotCollector(Collector):
    def __init__(self, exporter: MetricsExporter) -> None:
        self._exporter = exporter

    def collect(self) -> Iterator[Metric]:
        return metric_families(self._exporter.snapshot())


class MetricsExporter:
    """Serves /metrics on 127.0.0.1 from snapshots the daemon loop publishes on demand.

    Args:
        state: The daemon state (read by the loop thread only).
        requests: The loop's request counters.
        wake: Wakes the daemon loop from another thread (a write to its self-pipe).
        version: Daemon version for ``vqpool_daemon_info``.
    """

    def __init__(
        self,
        state: DaemonState,
        requests: RequestMetrics,
        wake: Callable[[], None],
        version: str,
    ) -> None:
        self._state = state
        self._requests = requests
        self._wake = wake
        self._version = version
        self._ready = threading.Condition()
        # Scrapes take increasing tickets; the loop publishes a snapshot taken after it read
        # the latest ticket, so every scrape sees the state from after it began.
        self._requested = 0
        self._published = 0
        self._snapshot = MetricsSnapshot.take(state, requests, version)
        self._server: Any = None
        self._stopped = False
        self.port: int | None = None

    def start(self, port: int) -> int:
        """Serve on ``port`` (0: any free port); the port served.

        Raises:
            OSError: The port cannot be bound.
        """
        registry = CollectorRegistry()
        registry.register(_SnapshotCollector(self))
        self._server, _ = start_http_server(port, addr=METRICS_ADDRESS, registry=registry)
        self.port = int(self._server.server_port)
        return self.port

    def stop(self) -> None:
        """Stop serving (scrapes in flight get the last snapshot)."""
        self._stopped = True  # the loop is gone: late scrapes must not write to its pipe
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def snapshot(self) -> MetricsSnapshot:
        """A snapshot taken after this call began (HTTP thread; the last one on timeout)."""
        with self._ready:
            if self._stopped:
                return self._snapshot
            self._requested += 1
            ticket = self._requested
            self._wake()
        with self._ready:
            self._ready.wait_for(lambda: self._published >= ticket, SNAPSHOT_WAIT_SECONDS)
            return self._snapshot

    def publish_if_wanted(self) -> None:
        """Publish a snapshot if a scrape waits for one (loop thread, between requests)."""
        ticket = self._requested  # an unlocked read: a stale one only defers to the next wake
        if ticket == self._published:
            return
        snap = MetricsSnapshot.take(self._state, self._requests, self._version)
        with self._ready:
            self._snapshot = snap
            self._published = ticket
            self._ready.notify_all()
