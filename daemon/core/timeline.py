"""Blocks in use per stream and per model over time, sampled by the daemon loop (for
``vqpoolctl history``).

The allocator's own history has one snapshot per mutating call, pool-wide counters only and no
clock: under load its 256 entries cover milliseconds, and it cannot tell keys from values. This
timeline is sampled by the loop's liveness tick (every 0.25 s), only when the pool changed since
the last sample, so it costs nothing per request and an idle daemon records nothing. A changed
tick also counts the blocks each model's sessions hold (O(allocation chunks held), four times
a second at most).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from vqpool.shared.allocator import DEFAULT_HISTORY_SIZE, BlockPoolAllocator

TIMELINE_SIZE = 3600
"""Samples kept: at least 15 minutes of a pool that changes on every tick."""

TIMELINE_MODELS = 16
"""Models kept per sample (those holding the most blocks): bounds a sample's size whatever
model names workers announce."""


class TimelineSample(NamedTuple):
    """The pool at one moment."""

    time: float
    in_use: tuple[int, ...]
    total: tuple[int, ...]
    n_allocations: int
    n_exhausted: int
    models: tuple[tuple[str, int], ...] = ()
    """(model, blocks its sessions hold) pairs, K and V blocks counted apart."""


class StreamTimeline:
    """A bounded record of blocks in use and total per stream, and held per model, with
    wall-clock times."""

    def __init__(self, streams: tuple[str, ...], size: int = TIMELINE_SIZE) -> None:
        self.streams = streams
        self._samples: deque[TimelineSample] = deque(maxlen=size)
        self._last_key: tuple[int, ...] | None = None

    def sample(
        self,
        allocator: BlockPoolAllocator,
        blocks_by_model: Callable[[], Mapping[str, int]],
    ) -> None:
        """Record the pool now, unless nothing changed since the last sample; the blocks per
        model come from ``blocks_by_model()`` (called only then)."""
        st = allocator.stats
        key = (st.n_allocations, st.n_frees, st.n_blocks, st.n_exhausted)
        if key == self._last_key:
            return
        self._last_key = key
        totals = tuple(allocator.n_total(s) for s in self.streams)
        pairs = zip(self.streams, totals, strict=True)
        in_use = tuple(total - allocator.n_free(stream) for stream, total in pairs)
        by_model = sorted(blocks_by_model().items(), key=lambda item: (-item[1], item[0]))
        self._samples.append(
            TimelineSample(
                time=time.time(),
                in_use=in_use,
                total=totals,
                n_allocations=st.n_allocations,
                n_exhausted=st.n_exhausted,
                models=tuple(by_model[:TIMELINE_MODELS]),
            )
        )

    def __len__(self) -> int:
        return len(self._samples)

    def to_wire(self, limit: int | None = None) -> list[dict[str, Any]]:
        """The samples, oldest first (the newest ``limit`` only, if given), as maps."""
        samples = list(self._samples)
        if limit is not None:
            samples = samples[-limit:]
        return [
            {
                "time": s.time,
                "in_use": dict(zip(self.streams, s.in_use, strict=True)),
                "total": dict(zip(self.streams, s.total, strict=True)),
                "n_allocations": s.n_allocations,
                "n_exhausted": s.n_exhausted,
                "models": dict(s.models),
            }
            for s in samples
        ]


class HistoryClock:
    """Wall-clock times of the allocator's history rows, which carry none (the seed's
    AllocationStats snapshots, kept as they are so the allocator's hot path stays a tuple copy).

    The daemon loop calls :meth:`stamp` once a turn: it compares the newest row with the newest
    one stamped (by identity: each row is a new tuple), so a turn that changed nothing costs one
    look, and stamps each new row with the time now. A row's time is so the end of the loop turn
    that recorded it (a turn is a batch of requests, milliseconds). The times are kept in a deque
    as long as the history, aligned on its newest end.
    """

    def __init__(self) -> None:
        self._times: deque[float] = deque(maxlen=DEFAULT_HISTORY_SIZE)
        self._last: tuple[int, ...] | None = None

    def stamp(self, allocator: BlockPoolAllocator, now: float | None = None) -> None:
        """Give every history row recorded since the last call the time ``now`` (default the
        wall clock)."""
        rows = allocator.history_rows
        if not rows or rows[-1] is self._last:
            return
        last = self._last
        new = 0
        for row in reversed(rows):
            if row is last:
                break
            new += 1
        stamp = time.time() if now is None else now
        self._times.extend([stamp] * new)
        self._last = rows[-1]

    def rows(self, allocator: BlockPoolAllocator) -> list[tuple[float | None, tuple[int, ...]]]:
        """The history rows, oldest first, each with its time (``None`` for a row older than the
        clock, which a fresh daemon never has); stamps rows not yet stamped first."""
        self.stamp(allocator)
        rows = list(allocator.history_rows)
        stamped = list(self._times)[-len(rows) :] if rows else []
        times: list[float | None] = [None] * (len(rows) - len(stamped))
        times.extend(stamped)
        return list(zip(times, rows, strict=True))
