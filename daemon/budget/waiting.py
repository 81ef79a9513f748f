"""The ledger's waiting requests: each model's queue in arrival order (its growths first), the
indices over all of them, and their deadlines.

Pure data structure for :class:`~vqpool.daemon.budget.ledger.BudgetLedger`, which decides who
waits and who is granted; this module only keeps the order and the indices consistent. A
model's record (:class:`ModelRecord`) holds its queue next to its holdings: the grant policy
reads both at once.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Hashable, Iterable

from vqpool.daemon.budget.types import ModelSettings, Ticket


class Waiter:
    """One request the ledger decides on, and keeps while it waits. ``growth`` marks a growth
    of held memory, queued ahead of its model's other requests; ``key`` is its growing party
    (None for a try_grant candidate); ``seq`` its place in arrival order, set when queued."""

    __slots__ = ("deadline", "enqueued_at", "growth", "key", "model", "n_bytes", "seq", "ticket")

    def __init__(
        self,
        ticket: Ticket,
        model: ModelRecord,
        n_bytes: int,
        deadline: float,
        now: float,
        growth: bool = False,
        key: Hashable | None = None,
    ) -> None:
        self.ticket = ticket
        self.model = model
        self.n_bytes = n_bytes
        self.deadline = deadline
        self.seq = 0
        self.enqueued_at = now
        self.growth = growth
        self.key = key


class ModelRecord:
    """One model's settings in effect, holdings and queue."""

    __slots__ = (
        "configured",
        "held",
        "limit",
        "n_growth",
        "name",
        "queue",
        "reserve",
        "settings",
        "waiting_bytes",
        "weight",
        "weight_keys",
        "weights",
    )

    def __init__(self, name: str, settings: ModelSettings, budget: int) -> None:
        self.name = name
        self.settings = settings
        self.configured = False
        self.reserve = settings.reserve
        self.limit = budget if settings.limit is None else min(settings.limit, budget)
        self.weight = float(settings.weight)
        self.held = 0
        self.weights = 0
        """Bytes of its loaded weights: the sum of ``weight_keys`` (not KV: outside its limit)."""
        self.weight_keys: dict[Hashable, int] = {}
        """Weights charged per holder (a worker session, or a pending load reservation)."""
        self.queue: OrderedDict[Ticket, Waiter] = OrderedDict()
        """Growths first (in arrival order), then the other requests (in arrival order)."""
        self.n_growth = 0  # growths at the front of the queue
        self.waiting_bytes = 0

    def head(self) -> Waiter:
        return next(iter(self.queue.values()))


CANDIDATE = object()
"""The ticket of a request tried against the queue without joining it (try_grant)."""


class WaitQueue:
    """Every waiting request, in its model's queue and in the indices below.

    Attributes:
        waiters: Waiting requests by ticket (the same dict for the queue's life).
        growth_keys: The one waiting growth of each growing party.
        queued_models: The models with waiting requests.
    """

    def __init__(self) -> None:
        self.waiters: dict[Ticket, Waiter] = {}
        self.growth_keys: dict[Hashable, Waiter] = {}
        self.queued_models: dict[ModelRecord, None] = {}
        self._deadlines: list[tuple[float, int, Waiter]] = []
        self._seq = 0
        self.version = 0
        """Bumped by every request queued or removed."""

    def enqueue(self, waiter: Waiter) -> None:
        """Queue ``waiter`` (numbered here: its place in arrival order)."""
        self._seq += 1
        self.version += 1
        waiter.seq = self._seq
        rec, ticket = waiter.model, waiter.ticket
        if not rec.queue:
            self.queued_models[rec] = None
        queue = rec.queue
        if waiter.growth:
            # In front of the model's other requests, behind its earlier growths (few: one
            # per party).
            earlier = list(itertools.islice(queue, rec.n_growth))
            queue[ticket] = waiter
            queue.move_to_end(ticket, last=False)
            for earlier_ticket in reversed(earlier):
                queue.move_to_end(earlier_ticket, last=False)
            rec.n_growth += 1
            if waiter.key is not None:
                self.growth_keys[waiter.key] = waiter
        else:
            queue[ticket] = waiter
        rec.waiting_bytes += waiter.n_bytes
        self.waiters[ticket] = waiter

    def remove(self, waiter: Waiter) -> None:
        """Take ``waiter`` out of its queue and the indices (its deadline entry stays until it
        is popped or compacted away)."""
        rec = waiter.model
        self.version += 1
        del rec.queue[waiter.ticket]
        del self.waiters[waiter.ticket]
        rec.waiting_bytes -= waiter.n_bytes
        if waiter.growth:
            rec.n_growth -= 1
            if waiter.key is not None:
                del self.growth_keys[waiter.key]
        if not rec.queue:
            del self.queued_models[rec]

    def add_deadline(self, waiter: Waiter) -> None:
        """Watch the deadline of ``waiter``, queued for good."""
        heapq.heappush(self._deadlines, (waiter.deadline, waiter.seq, waiter))

    def expire(self, now: float) -> list[Ticket]:
        """Remove and return the waiting tickets whose deadline is ``<= now``, earliest first."""
        expired: list[Ticket] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, _, waiter = heapq.heappop(heap)
            if self.waiters.get(waiter.ticket) is waiter:
                self.remove(waiter)
                expired.append(waiter.ticket)
        return expired

    def next_deadline(self) -> float | None:
        """The earliest deadline of a waiting request."""
        heap = self._deadlines
        while heap and self.waiters.get(heap[0][2].ticket) is not heap[0][2]:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def compact(self) -> None:
        """Drop deadline entries of requests no longer waiting once they outnumber the live
        ones, so granted and cancelled requests do not pile up in the heap."""
        if len(self._deadlines) > 2 * len(self.waiters) + 64:
            self._deadlines = [(w.deadline, w.seq, w) for w in self.waiters.values()]
            heapq.heapify(self._deadlines)

    def check_model(self, rec: ModelRecord) -> None:
        """Check ``rec``'s queue against its counts and the indices.

        Raises:
            AssertionError: With what disagrees (a bug in this module or the ledger).
        """
        flags = [w.growth for w in rec.queue.values()]
        assert flags == sorted(flags, reverse=True), f"{rec.name!r}: a growth behind others"
        assert rec.n_growth == sum(flags), f"{rec.name!r}: n_growth {rec.n_growth} off"
        waiters = list(rec.queue.values())
        for part_waiters in (waiters[: rec.n_growth], waiters[rec.n_growth :]):
            seqs = [w.seq for w in part_waiters]
            assert seqs == sorted(seqs), f"{rec.name!r}: queue out of arrival order"
        for waiter in waiters:
            if waiter.key is not None:
                assert waiter.growth, f"{waiter.ticket!r}: a growth key on a non-growth"
                assert self.growth_keys.get(waiter.key) is waiter, "growth key misindexed"
        for ticket, waiter in rec.queue.items():
            assert waiter.ticket == ticket and waiter.model is rec, f"misfiled {ticket!r}"
            assert self.waiters.get(ticket) is waiter, f"{ticket!r} missing from the index"
        waiting_bytes = sum(w.n_bytes for w in rec.queue.values())
        assert rec.waiting_bytes == waiting_bytes, f"{rec.name!r}: waiting bytes off"

    def check_indices(self, recs: Iterable[ModelRecord]) -> None:
        """Check the indices against every model's queue (after :meth:`check_model` of each).

        Raises:
            AssertionError: With what disagrees.
        """
        recs = list(recs)
        n_queued = sum(len(rec.queue) for rec in recs)
        assert n_queued == len(self.waiters), f"{len(self.waiters)} indexed, {n_queued} queued"
        keyed = sum(1 for w in self.waiters.values() if w.key is not None)
        assert keyed == len(self.growth_keys), "growth keys of waiters no longer waiting"
        queued_models = {rec for rec in recs if rec.queue}
        assert set(self.queued_models) == queued_models, "models with waiters misindexed"
        in_heap = {id(w) for _, _, w in self._deadlines}
        for waiter in self.waiters.values():
            assert id(waiter) in in_heap, f"{waiter.ticket!r} waits with no deadline entry"
            assert waiter.ticket is not CANDIDATE, "a try_grant candidate was left queued"
