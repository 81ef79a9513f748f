"""One served model's state in the front door: loaded or not, its worker, its requests, its
history of loads, unloads and failures.

States: ``not_loaded`` -> ``waiting_for_memory`` -> ``loading`` -> ``loaded`` -> ``unloading`` ->
``not_loaded``; in ``waiting_for_memory`` the load asks vqpoold's ledger for its bytes (and frees
them) before any worker starts. A load that fails or is refused, a wait given up, or a worker
that exits on its own goes straight back to ``not_loaded``. Only the
supervisor changes a slot, on the event loop's one thread, so a check and the change it leads
to never interleave with another request's.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from vqpool.daemon.front.catalog import ModelEntry
from vqpool.daemon.front.worker_process import WorkerProcess
from vqpool.shared.model_weights import WeightsEstimate, worker_overhead

DEMAND_HALF_LIFE = 30.0
"""Seconds after which a request counts half in a model's demand: long enough to span a chat's
pauses and a bursty model's quiet spells, short enough that a model no longer asked for stops
counting within minutes."""

NOT_LOADED = "not_loaded"
WAITING_FOR_MEMORY = "waiting_for_memory"
LOADING = "loading"
LOADED = "loaded"
UNLOADING = "unloading"

FAILURE_WINDOW = 300.0
"""Seconds a failed load or a crash counts toward backing off the next load."""
MAX_BACKOFF = 30.0
"""The longest a model's next load waits after repeated failures."""


@dataclass
class ModelSlot:
    """What the front door knows of one model (see the module docstring)."""

    entry: ModelEntry
    state: str = NOT_LOADED
    worker: WorkerProcess | None = None
    running: int = 0
    """Requests proxied to its worker now."""
    queued: int = 0
    """Requests waiting for it to load (or for room to load it)."""
    waiting_since: float = 0.0
    """When (monotonic) its oldest queued request came: loads waiting for room go oldest first."""
    answered: int = 0
    """Of those, the ones a failure already answered: they are leaving, no load starts for
    them."""
    keep_alive: float = 0.0
    """Seconds it stays loaded once idle: the model's, or the last ended request's own."""
    unload_when_idle: bool = False
    """An operator asked to unload it: it goes as soon as its requests end."""
    activity: int = 0
    """Bumped whenever a request starts or ends, so a stale idle timer knows it is stale."""
    idle_timer: asyncio.TimerHandle | None = None
    last_used: float | None = None
    """When (monotonic) its last request ended."""
    last_used_wall: float | None = None
    loaded_at: float | None = None
    loaded_at_wall: float | None = None
    unloaded_at_wall: float | None = None
    loads: int = 0
    unloads: dict[str, int] = field(default_factory=dict)
    """Unloads by reason: idle, room, operator, shutdown."""
    load_failures: int = 0
    crashes: int = 0
    refusals: int = 0
    """Loads the ledger refused because they can never fit."""
    memory_wait: str = ""
    """While it waits for memory: what its load needs and what is free (the ledger's numbers)."""
    last_load_seconds: float | None = None
    residency_wait: float = 0.0
    """Seconds its last (or current) load waited for memory while only models loaded less
    than ``min_residency`` seconds ago could have made room."""
    last_error: str = ""
    failure_times: deque[float] = field(default_factory=lambda: deque(maxlen=16))
    retry_at: float = 0.0
    """Monotonic time before which no load starts (a crash loop backs off)."""
    weights: WeightsEstimate | None = None
    """What its weights cost, known before it loads (None: unknown, e.g. a hub id not in the
    local cache); set once at start by :meth:`Supervisor.start`."""
    demand: float = 0.0
    """Requests that came for it, each counting less as it ages (halved every
    :data:`DEMAND_HALF_LIFE` seconds), as of :attr:`demand_at`: how much it is asked for."""
    demand_at: float = 0.0
    cache_limit: int = 0
    """The MLX buffer-cache limit its worker gets (its table's ``mlx_cache_limit``, else
    :func:`serve_cache_limit` of its weights): with the runtime's growth, declared to vqpoold
    as the model's overhead (:func:`worker_overhead`) and charged beside its weights; set once
    at start by :meth:`Supervisor.start`."""

    def __post_init__(self) -> None:
        self.keep_alive = self.entry.keep_alive

    def demand_now(self, now: float) -> float:
        """:attr:`demand` aged to monotonic time ``now``."""
        return self.demand * 0.5 ** (max(0.0, now - self.demand_at) / DEMAND_HALF_LIFE)

    def note_request(self, now: float) -> None:
        """A request came for it at monotonic time ``now``."""
        self.demand = self.demand_now(now) + 1.0
        self.demand_at = now

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def holds_room(self) -> bool:
        """Whether it counts toward ``--max-loaded`` (a worker exists or is being started)."""
        return self.state != NOT_LOADED

    @property
    def idle(self) -> bool:
        """Loaded with no running or queued request."""
        return self.state == LOADED and self.running == 0 and self.queued == 0

    @property
    def evictable(self) -> bool:
        """Whether a load of another model may unload it to make room."""
        return self.idle and not self.entry.pinned

    def evictable_for_memory(self, now: float, min_residency: float) -> bool:
        """Whether a load short of bytes may unload it: evictable and loaded at least
        ``min_residency`` seconds (so two models do not unload each other in turn)."""
        loaded_at = self.loaded_at or 0.0
        return self.evictable and now - loaded_at >= min_residency

    def in_conversation(self, now: float, gap: float) -> bool:
        """Whether its last request ended less than ``gap`` seconds before monotonic time
        ``now`` (its chat's next turn is likely soon)."""
        return self.last_used is not None and now - self.last_used < gap

    @property
    def failures(self) -> int:
        """Total failures (failed loads and crashes): what backs off the next load."""
        return self.load_failures + self.crashes

    @property
    def answers(self) -> int:
        """Failures and refusals: waiters compare it to see a new one, which answers them."""
        return self.failures + self.refusals

    def refuse(self, reason: str) -> None:
        """The load can never fit: every waiting request is answered with ``reason``."""
        self.refusals += 1
        self.last_error = reason
        self.answered = self.queued

    def record_failure(self, reason: str, now: float) -> None:
        """A load failed or the worker exited on its own: back off when it keeps happening."""
        self.last_error = reason
        self.answered = self.queued
        self.failure_times.append(now)
        recent = sum(1 for t in self.failure_times if now - t < FAILURE_WINDOW)
        backoff = 0.0 if recent < 2 else min(MAX_BACKOFF, 2.0 ** (recent - 2))
        self.retry_at = now + backoff

    def view(self, now: float) -> dict[str, Any]:
        """Its row for ``/v1/models``, ``vqpoolctl ps`` and ``status --json``."""
        idle_s = None
        keep_alive_left = None
        if self.state == LOADED and self.running == 0 and self.queued == 0:
            idle_s = 0.0 if self.last_used is None else now - self.last_used
            if self.entry.pinned or self.keep_alive == math.inf:
                keep_alive_left = None
            else:
                keep_alive_left = max(0.0, self.keep_alive - idle_s)
        worker = self.worker
        return {
            "name": self.name,
            "path": self.entry.path,
            "kv_format": self.entry.kv_format(),
            "kv_holding": _holding(self.entry),
            "aliases": list(self.entry.aliases),
            "state": self.state,
            "pid": None if worker is None else worker.pid,
            "url": worker.url if worker is not None and worker.address else None,
            "running": self.running,
            "queued": self.queued,
            "pinned": self.entry.pinned,
            "keep_alive_s": None if self.keep_alive == math.inf else self.keep_alive,
            "keep_alive_left_s": keep_alive_left,
            "idle_s": idle_s,
            "last_used": self.last_used_wall,
            "loaded_at": self.loaded_at_wall if self.state == LOADED else None,
            "unloaded_at": self.unloaded_at_wall,
            "loads": self.loads,
            "unloads": dict(self.unloads),
            "load_failures": self.load_failures,
            "crashes": self.crashes,
            "refusals": self.refusals,
            "memory_wait": self.memory_wait or None,
            "last_load_s": self.last_load_seconds,
            "last_error": self.last_error or None,
            "retry_in_s": max(0.0, self.retry_at - now) if self.retry_at > now else None,
            "unload_when_idle": self.unload_when_idle,
            "weights_bytes": None if self.weights is None else self.weights.nbytes,
            "weights_source": None if self.weights is None else self.weights.source,
            "overhead_bytes": worker_overhead(self.cache_limit),
        }


def _holding(entry: ModelEntry) -> dict[str, int] | None:
    """How its quantizing worker holds a sequence's blocks, for ``vqpoolctl fit`` to price a
    model not loaded as its worker will be (None: full precision)."""
    holding = entry.sequence_quantization()
    if holding is None:
        return None
    return {"start": holding.start, "first_pass_slots": holding.first_pass_slots}
