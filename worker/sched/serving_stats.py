"""Counters of one serving worker, served at ``GET /v1/stats`` (the demo's summary reads them).

Written by the generation thread and the HTTP threads, read by HTTP threads: one lock, taken
once per update (never per token: the scheduler adds a round's tokens at once).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

_COUNTERS = (
    "requests",  # submitted (queued)
    "prompt_tokens",
    "completion_tokens",
    "busy_seconds",  # seconds the generation thread spent in decode rounds
    "waits",  # requests that had to wait for free blocks before starting
    "exhaustions",  # requests ended early because the pool ran out of blocks mid-generation
    "preemptions",  # requests preempted (requeued, recomputed on resume) to make room
    "reclaim_preemptions",  # of the preemptions, those that answered a reclaim ask
    "reserved_whole",  # with --reserve auto: of the admitted, those reserving prompt + max_tokens
    "held_for_growth",  # admissions held: the running rows' next growth could not be backed
    "draft_accepted",  # generated tokens a draft model proposed and the model accepted
    "queue_timeouts",  # requests rejected after --queue-timeout in the queue
    "rejected_queue_full",  # requests refused at once: the queue was at --max-queue
    "admitted",  # requests started for the first time (not resumes)
    "admission_wait_seconds",  # summed over them: seconds from submit to that start
    "resume_wait_seconds",  # summed over resumes: seconds from a preemption to the resume
    "prefill_tokens",  # tokens prefilled (what the prompt cache gave is not)
    "recompute_tokens",  # of those, the tokens of resumed requests (prefilled again)
    "decode_steps",  # batched decode steps (one token per row)
    "decode_rows",  # rows decoded, summed over the steps: / decode_steps is the mean batch
    "decode_slots",  # slots the steps' buffers held (rows x batch length, padding included)
    "token_slots",  # of those, slots the rows' own tokens fill (the rest is left padding)
    "grow_seconds",  # of busy_seconds, in pool calls growing caches (daemon waits included)
    "row_seconds",  # requests started (running or prefilling) x wall seconds: / uptime the mean
    "block_seconds",  # blocks the requests hold (K and V apart) x wall seconds
    "queued_at_most_seconds",  # seconds a request waited with --max-concurrent started
    "queued_below_most_seconds",  # seconds one waited with fewer started: memory, not the cap
    "prefill_seconds",  # of busy_seconds, in prefill chunks (their growth included)
    "ended_stop",
    "ended_length",
    "ended_cancelled",
    "ended_error",
    "ended_rejected",
)


class ServingStats:
    """Counters, current levels and peaks of one worker (see :meth:`snapshot`).

    ``on_load(running, queued, preemptions)``, if given, is called (under the lock, so calls
    arrive in order) whenever the number of running or queued requests or of preemptions
    changes: the pooled worker passes it on to the daemon. It must not block.
    ``prompt_cache()``, if given, returns the prompt cache's counters (``PromptCache.snapshot``),
    served as ``prompt_cache`` (null without a cache).
    """

    def __init__(
        self,
        *,
        max_concurrent: int,
        pooled: bool,
        on_load: Callable[[int, int, int], None] | None = None,
        prompt_cache: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._on_load = on_load
        self._prompt_cache = prompt_cache
        self._counters: dict[str, float] = dict.fromkeys(_COUNTERS, 0)
        self._started = time.time()
        self._max_concurrent = max_concurrent
        self._pooled = pooled
        self._active = 0
        self._queue_length = 0
        self._peak_queue_length = 0
        self._blocked = False
        self._blocks = 0
        self._peak_blocks = 0
        self._bytes = 0
        self._peak_bytes = 0
        if on_load is not None:  # idle to start with: "0 running" rather than "not reported"
            on_load(0, 0, 0)

    def add(self, **deltas: float) -> None:
        """Add to named counters (names from the module's list; others raise KeyError)."""
        with self._lock:
            for name, delta in deltas.items():
                if name not in self._counters:
                    raise KeyError(f"ServingStats: unknown counter {name!r}")
                self._counters[name] += delta
            if deltas.get("preemptions") and self._on_load is not None:
                self._on_load(self._active, self._queue_length, self._preemptions)

    def set_queue_length(self, n: int) -> None:
        with self._lock:
            changed = n != self._queue_length
            self._queue_length = n
            self._peak_queue_length = max(self._peak_queue_length, n)
            if changed and self._on_load is not None:
                self._on_load(self._active, n, self._preemptions)

    def set_active(self, n: int) -> None:
        with self._lock:
            changed = n != self._active
            self._active = n
            if changed and self._on_load is not None:
                self._on_load(n, self._queue_length, self._preemptions)

    @property
    def _preemptions(self) -> int:
        return int(self._counters["preemptions"])

    def set_blocked(self, blocked: bool) -> None:
        """Whether the head of the queue is waiting for free blocks right now."""
        with self._lock:
            self._blocked = blocked

    def set_memory(self, n_blocks: int, n_bytes: int) -> None:
        with self._lock:
            self._blocks = n_blocks
            self._bytes = n_bytes
            self._peak_blocks = max(self._peak_blocks, n_blocks)
            self._peak_bytes = max(self._peak_bytes, n_bytes)

    def snapshot(self) -> dict[str, Any]:
        """Everything, as JSON-ready values; ``tokens_per_s`` is generated tokens per busy
        second of the generation thread (all requests together)."""
        with self._lock:
            out: dict[str, Any] = {
                k: (round(v, 3) if k.endswith("_seconds") else int(v))
                for k, v in self._counters.items()
            }
            busy = self._counters["busy_seconds"]
            tokens = self._counters["completion_tokens"]
            out["tokens_per_s"] = round(tokens / busy, 1) if busy else 0.0
            out.update(
                pooled=self._pooled,
                max_concurrent=self._max_concurrent,
                active=self._active,
                queue_length=self._queue_length,
                peak_queue_length=self._peak_queue_length,
                waiting_for_blocks=self._blocked and self._queue_length > 0,
                blocks=self._blocks,
                peak_blocks=self._peak_blocks,
                bytes=self._bytes,
                peak_bytes=self._peak_bytes,
                uptime_s=round(time.time() - self._started, 3),
            )
        # Outside the lock: the prompt cache has its own.
        out["prompt_cache"] = None if self._prompt_cache is None else self._prompt_cache()
        return out
