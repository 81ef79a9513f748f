"""One memory budget in bytes across models: the ledger of who holds what, and who gets what next.

Pure bookkeeping: no I/O, no clock (times are passed in), no blocks. The daemon charges a
model the bytes of the blocks it hands out (blocks x the session's bytes per block of that
stream) and credits them back when they are freed; before handing blocks out it asks
:meth:`BudgetLedger.request` whether the bytes may go now. See ``docs/budget.md`` for the rules
in prose, the policy order and the reasons behind each choice.

Typical wiring (the integrator's side)::

    ledger = BudgetLedger(budget, {"llama": ModelSettings(reserve=2 * GiB)})
    verdict = ledger.request(model, n_bytes, ticket, deadline, now)
    if verdict.outcome is Outcome.GRANT:   # charged: allocate the blocks now
        ...
    elif verdict.queued:                   # WAIT: answer later, when grants() names ticket
        ...
    else:  # NEVER, QUEUE_FULL, or WAIT with no time left to wait: reply verdict.message()
        ...
    # after freeing blocks (credit), a setting change, cancel() or expire():
    ledger.credit(model, n_bytes)
    for ticket in ledger.grants():         # already charged, in policy order
        ...
    for ticket in ledger.expire(now):      # deadline passed, no longer waiting
        ...

A model's name is the ``model`` a worker gives in ``hello``; every session of one model shares
its settings and its holdings here.

This module is the policy (requests, who waits, who is granted next, what reclaim must take
back); the holdings and the three rules are the book's (``budget/model_book.py``), the queue's
order and indices ``budget/waiting.py``'s, the fair shares ``budget/shares.py``'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping

from vqpool.daemon.budget.model_book import ModelBook, check_budget, never_reason
from vqpool.daemon.budget.shares import ShareTable, water_fill
from vqpool.daemon.budget.types import (
    DEFAULT_SETTINGS,
    GRANTED,
    BudgetSnapshot,
    FitAnswer,
    FitVerdict,
    LoadOutcome,
    LoadVerdict,
    ModelBudgetView,
    ModelSettings,
    Outcome,
    Reason,
    ReclaimNeed,
    Ticket,
    Verdict,
)
from vqpool.daemon.budget.waiting import CANDIDATE, ModelRecord, Waiter, WaitQueue
from vqpool.shared.byte_sizes import MAX_BYTES

__all__ = [
    "DEFAULT_MAX_WAITING",
    "DEFAULT_MAX_WAITING_PER_MODEL",
    "DEFAULT_SETTINGS",
    "GRANTED",
    "BudgetLedger",
    "BudgetSnapshot",
    "FitAnswer",
    "FitVerdict",
    "LoadOutcome",
    "LoadVerdict",
    "ModelBudgetView",
    "ModelSettings",
    "Outcome",
    "Reason",
    "ReclaimNeed",
    "Ticket",
    "Verdict",
    "bytes_for_context",
    "water_fill",
]

DEFAULT_MAX_WAITING_PER_MODEL = 256
DEFAULT_MAX_WAITING = 1024
"""Waiting requests allowed per model and in all. A worker waits on at most a few allocations per
running sequence; a queue longer than this means the budget is far too small for the load, and
refusing (QUEUE_FULL) tells the worker so instead of growing the daemon's memory."""


def bytes_for_context(
    context_tokens: int,
    block_size: int,
    bytes_per_block: Mapping[str, int],
    streams: Iterable[str] | None = None,
) -> int:
    """Bytes one sequence of ``context_tokens`` tokens takes: ceil(tokens / block_size) blocks
    of each stream, times that stream's bytes per block.

    Args:
        context_tokens: Tokens of the sequence (prompt + generated), at least 1.
        block_size: Token slots per block (the pool's ``block_size``).
        bytes_per_block: Bytes one block of each stream takes (what the model's workers declared
            in ``hello``).
        streams: The streams the pool uses (``allocator.streams``: "k" and "v", or "kv"); None
            means every key of ``bytes_per_block``. Pass it when the worker declared more streams
            than the pool has (``vqpool-worker`` declares k, v and kv), or they are all counted.

    Raises:
        ValueError: A count below 1, a negative byte size, or a stream with no bytes per block.
    """
    for name, value in (("context_tokens", context_tokens), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    names = list(bytes_per_block) if streams is None else list(streams)
    if not names:
        raise ValueError("bytes_for_context: no streams to count")
    blocks = -(-context_tokens // block_size)
    total = 0
    for stream in names:
        size = bytes_per_block.get(stream)
        if size is None:
            raise ValueError(f"no bytes per block declared for stream {stream!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"bytes per block of stream {stream!r} must be an int >= 0")
        total += blocks * size
    return total


class BudgetLedger:
    """Bytes held per model against one budget, and the queue of requests waiting for bytes.

    A request of ``n`` bytes by model ``m`` fits when all three hold (the book of holdings,
    :class:`~vqpool.daemon.budget.model_book.ModelBook`, keeps them):

    - ``total_held + total_weights + n <= budget``;
    - ``held(m) + n <= limit(m)`` (its limit, or the budget if smaller);
    - ``n <= budget - total_weights - total_held - protected(others)``, where
      ``protected(others)`` is the sum of ``max(0, reserve - held)`` over the other models:
      their unused reserves are theirs.

    Loaded models' weights (:meth:`set_weights`, :meth:`reserve_load`) are charged beside the
    KV: reserves and limits bound KV only, and the KV's room is the budget less the weights.

    It is granted at once when it fits and no waiting request comes before it in the policy
    order (see :meth:`grants`); otherwise it waits (:meth:`request`) or is refused (NEVER when
    it could not fit even if every other model gave everything back). Every method that
    refuses raises or answers before changing anything.

    Args:
        budget: Bytes all models may hold together, in [1, 2**50].
        models: Settings of the configured models; any other model gets :data:`DEFAULT_SETTINGS`
            when it first asks.
        max_waiting_per_model: Waiting requests allowed per model.
        max_waiting: Waiting requests allowed in all.
        lend_reserves: Let grants take unused reserves (the third rule is dropped): a reserve
            becomes a guarantee that :meth:`reclaim_need` restores by taking bytes back from
            the models above their share, instead of bytes kept idle.

    Raises:
        ValueError: A bad budget or queue bound, a model whose settings are not
            :class:`ModelSettings`, or reserves summing over the budget.
    """

    def __init__(
        self,
        budget: int,
        models: Mapping[str, ModelSettings] | None = None,
        *,
        max_waiting_per_model: int = DEFAULT_MAX_WAITING_PER_MODEL,
        max_waiting: int = DEFAULT_MAX_WAITING,
        lend_reserves: bool = False,
    ) -> None:
        check_budget(budget)
        for name, value in (
            ("max_waiting_per_model", max_waiting_per_model),
            ("max_waiting", max_waiting),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        self._book = ModelBook(budget, models, lend_reserves)
        self._queue = WaitQueue()
        # The book's records and the queue's index, read on every request (the same dicts).
        self._models = self._book.models
        self._waiters = self._queue.waiters
        self._pending: list[Ticket] = []
        self._settled = True  # no waiting request could be granted now (see _settle)
        self._shares: tuple[int, ShareTable] | None = None  # (generation, table) of the last
        self.max_waiting_per_model = max_waiting_per_model
        self.max_waiting = max_waiting

    # -- reading --------------------------------------------------------------------------

    @property
    def budget(self) -> int:
        return self._book.budget

    @property
    def total_held(self) -> int:
        return self._book.total_held

    @property
    def total_weights(self) -> int:
        """Bytes of weights charged in all (beside :attr:`total_held`, which is KV)."""
        return self._book.total_weights

    @property
    def free(self) -> int:
        """Bytes neither held as KV nor charged as weights (0 when over the budget)."""
        return max(0, self._book.kv_budget - self._book.total_held)

    @property
    def over_budget(self) -> bool:
        """Whether KV and weights together are over the budget (a lowered budget, weights
        measured larger): nothing is granted until they are back under."""
        return self._book.total_held > self._book.kv_budget

    @property
    def lend_reserves(self) -> bool:
        return self._book.lend_reserves

    @property
    def n_waiting(self) -> int:
        """Requests waiting in all (0 means :meth:`grants` has nothing to do)."""
        return len(self._waiters)

    @property
    def generation(self) -> int:
        """Changes whenever holdings, settings or the waiting requests change: while it stays
        the same, :meth:`reclaim_need` answers the same."""
        return self._book.version + self._queue.version

    def held(self, model: str) -> int:
        """Bytes ``model`` holds (0 for a model never seen)."""
        return self._book.held(model)

    def weights(self, model: str) -> int:
        """Bytes of weights charged to ``model`` (0 for a model never seen)."""
        found = self._models.get(model)
        return 0 if found is None else found.weights

    def weights_of(self, model: str, key: Hashable) -> int:
        """Bytes of weights charged to ``model`` under holder ``key`` (0: none)."""
        found = self._models.get(model)
        return 0 if found is None else found.weight_keys.get(key, 0)

    def settings_of(self, model: str) -> ModelSettings:
        """The settings in effect for ``model`` (the defaults for an unconfigured one); change one
        field with ``dataclasses.replace(ledger.settings_of(m), reserve=...)``."""
        return self._book.settings_of(model)

    def is_waiting(self, ticket: Ticket) -> bool:
        return ticket in self._waiters

    # -- holdings -------------------------------------------------------------------------

    def charge(self, model: str, n_bytes: int) -> None:
        """Add ``n_bytes`` to ``model``'s holdings unconditionally: for blocks that are already
        held (claims after a restart, an allocation decided elsewhere). May take the total over
        the budget; then nothing is granted until holdings are back under it."""
        _check_amount(n_bytes)
        found = self._models.get(model)
        self._add(self._book.record(model) if found is None else found, n_bytes)

    def credit(self, model: str, n_bytes: int) -> None:
        """Take ``n_bytes`` off ``model``'s holdings (its blocks were freed). Call :meth:`grants`
        afterwards when :attr:`n_waiting` is not 0.

        Raises:
            ValueError: More than the model holds (a bookkeeping bug in the caller: nothing is
                changed, so the ledger stays consistent).
        """
        _check_amount(n_bytes)
        found = self._models.get(model)
        held = 0 if found is None else found.held
        if n_bytes > held or found is None:
            if n_bytes == 0:
                return
            raise ValueError(
                f"credit of {n_bytes} bytes to model {model!r}, which holds only {held}: "
                "the caller's accounting is wrong (nothing changed)"
            )
        self._add(found, -n_bytes)

    def _add(self, model: ModelRecord, n_bytes: int) -> None:
        """Holdings of ``model`` += ``n_bytes`` (either sign): waiting requests may go now."""
        self._book.add(model, n_bytes)
        self._settled = False

    def set_weights(self, model: str, key: Hashable, n_bytes: int) -> None:
        """Charge ``n_bytes`` of weights to ``model`` under holder ``key`` (a worker session, a
        load reservation), replacing what the key held; 0 removes the key. Unconditional, as
        :meth:`charge`: a measurement may take the total over the budget, and then nothing is
        granted until under (:meth:`reclaim_need` counts the excess). Call :meth:`grants`
        afterwards when :attr:`n_waiting` is not 0.

        Raises:
            ValueError: ``n_bytes`` is not an int in [0, MAX_BYTES].
        """
        _check_amount(n_bytes)
        found = self._models.get(model)
        if found is None:
            if not n_bytes:
                return
            found = self._book.record(model)
        if self._book.set_weights(found, key, n_bytes):
            self._settled = False

    def reserve_load(self, model: str, key: Hashable, weights: int, kv_min: int) -> LoadVerdict:
        """Charge ``weights`` to ``model`` under ``key`` if the model could be loaded now with
        ``kv_min`` bytes of KV free for it (GRANT); else say how many bytes are short (SHORT:
        nothing charged), or that it could never fit (NEVER: over its limit, or ``weights +
        max(kv_min, reserve)`` over the budget less the other models' reserves).

        Raises:
            ValueError: ``weights`` or ``kv_min`` is not an int in [0, MAX_BYTES], or ``key``
                already holds weights of ``model``.
        """
        _check_amount(weights)
        _check_amount(kv_min)
        book = self._book
        found = self._models.get(model)
        if found is not None and key in found.weight_keys:
            raise ValueError(f"{key!r} already holds weights of model {model!r}")
        rec = found if found is not None else book.record(model)
        try:
            others_reserved = book.reserved - rec.reserve
            free = max(0, book.kv_budget - book.total_held - book.protected_from(rec))
            need = weights + kv_min
            if kv_min > rec.limit or weights + max(kv_min, rec.reserve) > (
                book.budget - others_reserved
            ):
                outcome, short = LoadOutcome.NEVER, max(0, need - free)
            elif need <= free:
                outcome, short = LoadOutcome.GRANT, 0
                self.set_weights(model, key, weights)
            else:
                outcome, short = LoadOutcome.SHORT, need - free
        finally:
            if found is None and not (rec.held or rec.queue or rec.weights):
                del self._models[model]
        return LoadVerdict(
            outcome, model, weights, kv_min, free, short, book.budget, others_reserved, rec.limit
        )

    # -- requests -------------------------------------------------------------------------

    def try_grant(self, model: str, n_bytes: int, *, growth: bool = False) -> Verdict:
        """Grant ``n_bytes`` to ``model`` now (charged) or say why not; never queues.

        Waiting requests that the policy serves first are not overtaken (WAIT with
        BEHIND_WAITERS); a ``growth`` (of memory the model holds, see :meth:`request`) goes
        ahead of its own model's waiting requests that are not growths. O(1) while nobody
        waits.

        Raises:
            ValueError: ``n_bytes`` is not an int >= 0.
        """
        if type(n_bytes) is not int or n_bytes < 0:
            _refuse_request_size(n_bytes)
        rec = self._models.get(model)
        if rec is None:
            return self._as_new_model(model, lambda: self.try_grant(model, n_bytes, growth=growth))
        if self._waiters:
            candidate = Waiter(CANDIDATE, rec, n_bytes, math.inf, 0.0, growth)
            return self._decide(candidate, queue=False)
        book = self._book
        if book.take(rec, n_bytes):  # the hot path: the three rules, inlined
            return GRANTED
        if n_bytes > book.ceiling(rec):
            return self._refusal(rec, n_bytes, never_reason(rec, n_bytes), queued=False)
        return self._refusal(rec, n_bytes, book.shortage(rec, n_bytes), queued=False)

    def request(
        self,
        model: str,
        n_bytes: int,
        ticket: Ticket,
        deadline: float,
        now: float,
        *,
        growth: Hashable | None = None,
    ) -> Verdict:
        """Grant ``n_bytes`` to ``model`` now (charged), or queue it under ``ticket`` until
        ``deadline``, or refuse it (NEVER, QUEUE_FULL: not queued).

        A *growth* (``growth`` names the growing party, e.g. a worker session: a running
        request needs another block) differs in three ways, so that the weights govern growth
        as they govern admissions without a growth waiting behind its own model's admissions
        (which wait for the bytes its running requests hold):

        - it queues ahead of its model's requests that are not growths (behind earlier
          growths), so the policy order sees it as its model's head;
        - it waits only while its model is owed it: when its model's holdings with it would
          exceed the model's entitlement (:meth:`snapshot`), it is answered at once (WAIT,
          ABOVE_SHARE, not queued): nothing would be taken back for it, and the worker had
          better preempt one of its own requests now;
        - at most one growth of each party waits: another one is answered at once
          (GROWTH_WAITING, not queued).

        A queued request is granted by a later :meth:`grants` call (which names its ticket,
        already charged), leaves by :meth:`cancel`, or by :meth:`expire` once ``deadline`` has
        passed. A request whose ``deadline <= now`` is answered at once, like :meth:`try_grant`.

        If :meth:`grants` was not called after the last change, placing this request first
        settles the queue, which may grant other waiting requests too: the next :meth:`grants`
        returns them (the same holds for :meth:`try_grant`).

        Args:
            model: The requesting model's name.
            n_bytes: Bytes it asks for (0 is granted at once: it takes nothing from anyone).
            ticket: Unique among waiting requests.
            deadline: Monotonic time after which it stops waiting.
            now: Monotonic time now (its arrival, shown as its waiting age).

        Raises:
            ValueError: ``n_bytes`` is not an int >= 0, or ``ticket`` already waits.
        """
        is_growth = growth is not None
        if ticket in self._waiters:
            raise ValueError(f"ticket {ticket!r} already waits for memory")
        if deadline != deadline or now != now:  # NaN would corrupt the deadline heap's order
            raise ValueError(f"deadline and now must be numbers, got {deadline!r} and {now!r}")
        if type(n_bytes) is not int or n_bytes < 0:
            _refuse_request_size(n_bytes)
        if model not in self._models:
            return self._as_new_model(
                model,
                lambda: self.request(model, n_bytes, ticket, deadline, now, growth=growth),
            )
        if deadline <= now:
            return self.try_grant(model, n_bytes, growth=is_growth)
        if not self._waiters:
            verdict = self.try_grant(model, n_bytes, growth=is_growth)
            if verdict.outcome is not Outcome.WAIT:
                return verdict
        rec = self._models[model]
        if is_growth and growth in self._queue.growth_keys:
            verdict = self.try_grant(model, n_bytes, growth=True)
            if verdict.outcome is Outcome.WAIT:
                return self._refusal(rec, n_bytes, Reason.GROWTH_WAITING, queued=False)
            return verdict
        request = Waiter(ticket, rec, n_bytes, deadline, now, is_growth, growth)
        return self._decide(request, queue=True)

    def _as_new_model(self, model: str, call: Callable[[], Verdict]) -> Verdict:
        """``call()`` for a model seen for the first time, whose record is kept only if the
        request was granted or queued: a refusal leaves no trace."""
        self._book.record(model)
        try:
            verdict = call()
        finally:
            rec = self._models[model]
            if not (rec.held or rec.queue):
                del self._models[model]
        return verdict

    def _decide(self, request: Waiter, queue: bool) -> Verdict:
        """The slow path: NEVER, or where the policy puts ``request`` (not queued yet) among
        the waiting ones; ``queue``: whether it may wait."""
        rec, n_bytes = request.model, request.n_bytes
        if n_bytes == 0:
            return GRANTED
        if n_bytes > self._book.ceiling(rec):
            return self._refusal(rec, n_bytes, never_reason(rec, n_bytes), queued=False)
        # First come first served within a model; a growth only after earlier growths.
        if rec.n_growth if request.growth else rec.queue:
            return self._wait(request, queue, Reason.BEHIND_WAITERS)
        # In a settled queue a request that does not fit waits, and joining the queue lets no
        # other request go (it adds demand; it frees nothing). One that fits may be first in
        # the policy order, or within its share past a blocked head: let the policy decide.
        # A growth goes in front of its model's other waiting requests: with them it may
        # settle anew.
        if not self._settled or self._book.fits(rec, n_bytes):
            self._queue.enqueue(request)
            self._settle()
            if request.ticket not in self._waiters:  # granted by the policy just now
                if request.ticket is not CANDIDATE:
                    self._pending.remove(request.ticket)
                return GRANTED
            self._queue.remove(request)
            # The queue was settled with the request in it. Without it, a head it held back
            # (placed ahead of it and blocked, or its demand lowering their share) may go: the
            # next grants() must look again, unless the request is queued back in its place.
            self._settled = False
            verdict = self._wait(request, queue, self._book.shortage(rec, n_bytes))
            if verdict.queued:
                # The newest of the waiting, as when settled: the queue is as it was then.
                self._settled = True
            return verdict
        return self._wait(request, queue, self._book.shortage(rec, n_bytes))

    def _wait(self, request: Waiter, queue: bool, reason: Reason) -> Verdict:
        """Queue ``request`` if it may wait and there is room, and say why it waits."""
        rec, n_bytes = request.model, request.n_bytes
        if not queue:
            return self._refusal(rec, n_bytes, reason, queued=False)
        full = None
        if len(rec.queue) >= self.max_waiting_per_model:
            full = Reason.MODEL_QUEUE_FULL
        elif len(self._waiters) >= self.max_waiting:
            full = Reason.ALL_QUEUES_FULL
        if full is not None:
            return self._refusal(rec, n_bytes, full, queued=False, outcome=Outcome.QUEUE_FULL)
        self._queue.enqueue(request)
        if request.growth and rec.held + n_bytes > self._book.entitlements().get(rec, 0.0):
            # Not owed: no reclaim would be planned for it, and others may be owed first.
            self._queue.remove(request)
            return self._refusal(rec, n_bytes, Reason.ABOVE_SHARE, queued=False)
        self._queue.add_deadline(request)
        return self._refusal(rec, n_bytes, reason, queued=True)

    def _refusal(
        self,
        rec: ModelRecord,
        n_bytes: int,
        reason: Reason,
        queued: bool,
        outcome: Outcome = Outcome.WAIT,
    ) -> Verdict:
        if outcome is Outcome.WAIT and reason in (Reason.OVER_LIMIT, Reason.OVER_CEILING):
            outcome = Outcome.NEVER
        return Verdict(
            outcome,
            reason,
            queued,
            rec.name,
            n_bytes,
            rec.held,
            rec.limit,
            self._book.ceiling(rec),
            self._book.budget,
            self._book.total_held,
            self._book.protected_from(rec),
            self._book.total_weights,
        )

    # -- the queue ------------------------------------------------------------------------

    def cancel(self, ticket: Ticket) -> bool:
        """Stop waiting for ``ticket`` (its client gave up or its session ended). Returns whether
        it was waiting. Call :meth:`grants` afterwards: a blocked request at the front of the
        policy order may have held others back.

        A ticket already granted but not yet returned by :meth:`grants` is not waiting: this
        returns False and its bytes stay charged; credit them if its blocks will not be handed
        out."""
        waiter = self._waiters.get(ticket)
        if waiter is None:
            return False
        self._queue.remove(waiter)
        self._settled = False
        self._queue.compact()
        return True

    def expire(self, now: float) -> list[Ticket]:
        """Remove and return the waiting tickets whose deadline is ``<= now``, earliest first.
        Call :meth:`grants` afterwards when any expired (see :meth:`cancel`)."""
        expired = self._queue.expire(now)
        if expired:
            self._settled = False
        return expired

    def next_deadline(self) -> float | None:
        """The earliest deadline of a waiting request (for the caller's poll timeout)."""
        return self._queue.next_deadline()

    def grants(self) -> list[Ticket]:
        """Grant what the policy allows now, and return the tickets granted (each already
        charged) since the last call, in the order they were granted.

        Call it after anything that can let a waiting request go: :meth:`credit`,
        :meth:`set_budget`, :meth:`set_model`, :meth:`cancel`, :meth:`expire`. O(1) when nobody
        waits.

        The policy, applied until no waiting request can go:

        1. Within a model, first come first served (its growths ahead of its other requests, see
           :meth:`request`): only the head of its queue is considered.
        2. A head blocked only by its own model's limit is passed over: it waits for its own
           model's bytes and holds up nobody else.
        3. Models below their reserve go first, in the order their heads arrived.
        4. Then the others by weighted max-min: the smallest ``(held + head) / weight`` first
           (ties by arrival), the model's holdings once its head is granted.
        5. Backfill: when a model's head does not fit (budget full, or other models' reserves),
           models after it in this order may still be granted, but only up to their
           entitlement (the water-filling share of :class:`ModelBudgetView`). Freed bytes
           beyond their fair shares thus stay free until the blocked head fits, so a large
           request is not starved by a stream of small ones, and no model below its fair share
           waits for a larger one. A model below its reserve is never held back.
        """
        if self._waiters and not self._settled:
            self._settle()
        if not self._pending:
            return []
        granted = self._pending
        self._pending = []
        self._queue.compact()
        return granted

    def _settle(self) -> None:
        """Grant waiting heads in policy order until none can go (see :meth:`grants`); granted
        tickets are appended to ``_pending``."""
        entitlement: dict[ModelRecord, float] | None = None
        while True:
            heads = []
            for rec in self._queue.queued_models:
                head = next(iter(rec.queue.values()))
                if rec.held + head.n_bytes <= rec.limit:  # else it waits for its own bytes
                    heads.append((_policy_key(rec, head), head))
            heads.sort(key=_first)
            blocked_ahead = False
            for _, head in heads:
                rec = head.model
                if self._book.fits(rec, head.n_bytes):
                    if blocked_ahead and rec.held >= rec.reserve:
                        if entitlement is None:
                            # Demand (held + waiting) does not change while granting: a grant
                            # moves bytes from waiting to held. One computation serves the pass.
                            entitlement = self._book.entitlements()
                        if rec.held + head.n_bytes > entitlement.get(rec, 0.0):
                            continue
                    self._grant(head)
                    break
                blocked_ahead = True
            else:
                self._settled = True
                return

    def _grant(self, waiter: Waiter) -> None:
        rec = waiter.model
        self._queue.remove(waiter)
        self._add(rec, waiter.n_bytes)
        assert rec.held <= rec.limit and self._book.total_held <= self._book.kv_budget, (
            f"granted {waiter.n_bytes} to {rec.name!r} beyond its limit or the budget"
        )
        if waiter.ticket is not CANDIDATE:
            self._pending.append(waiter.ticket)

    def reclaim_need(self, up_to_share: bool = True, margin: float = 0.0) -> ReclaimNeed:
        """What must be taken back now, and from whom (see :class:`ReclaimNeed`).

        A waiting model is owed the prefix of its queue that fits within its entitlement
        (which is at least its demand up to its reserve): a model below its reserve, or below
        its fair share while others are above theirs. With ``up_to_share`` False only the
        reserves are restored: a model is owed at most up to its reserve (fair shares above
        reserves are left to bytes freed as requests end). ``short`` is what of that, plus any
        holdings over a lowered budget, the free bytes do not cover; never more. Pure: the
        caller asks the workers of the ``excess`` models for it and credits what they free.

        ``margin`` (a fraction in [0, 1)) is the hysteresis of fair-share reclaim: a model is
        owed bytes above its reserve only while it holds less than ``(1 - margin)`` of its
        *full share*, the entitlement it would have if it wanted all it may hold (its limit),
        the others' demand unchanged. A preemption frees whole requests, so the victim often
        lands a little below its own share; without a margin it would ask back at once, and two
        models that both want more than their share would take bytes from each other in turn.
        (The full share, not the entitlement, is the yardstick: the entitlement is capped at
        the model's demand, so a model waiting for one block would never be short of it by
        more than the block.) Reserves are owed whatever the margin.
        """
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"margin must be a fraction in [0, 1), got {margin!r}")
        book = self._book
        over = max(0, book.total_held - book.kv_budget)
        if not self._waiters and not over:
            return ReclaimNeed(0, {}, [])
        # One water-filling per state of the ledger: the full shares are read off it.
        generation = self.generation
        if self._shares is None or self._shares[0] != generation:
            self._shares = (generation, book.share_table())
        table = self._shares[1]
        entitlement = table.entitlement
        wanted: dict[str, int] = {}
        unused_of_wanting = 0
        for rec in self._queue.queued_models:
            share = entitlement.get(rec, 0.0)
            owed_share = up_to_share and rec.held < share
            if owed_share and margin:
                owed_share = rec.held < (1.0 - margin) * table.full_share(rec)
            target = min(share, rec.limit if owed_share else rec.reserve)
            want = 0
            for waiter in rec.queue.values():
                if rec.held + want + waiter.n_bytes > target:
                    break
                want += waiter.n_bytes
            if want:
                wanted[rec.name] = want
                unused_of_wanting += rec.reserve - rec.held if rec.held < rec.reserve else 0
        if wanted:
            # The wanting models may take free bytes and their own unused reserves.
            protected_others = 0 if book.lend_reserves else book.protected - unused_of_wanting
            usable = book.kv_budget - book.total_held - protected_others
            short = max(0, sum(wanted.values()) - usable)
        else:
            short = over
        if not short:
            return ReclaimNeed(0, wanted, [])
        # Floored: a model is asked for whole bytes down to its share, never below it by more
        # than the byte the rounding takes.
        excess = [
            (rec, rec.held - int(entitlement.get(rec, 0.0)))
            for rec in self._models.values()
            if rec.held > int(entitlement.get(rec, 0.0))
        ]
        excess.sort(key=lambda item: (-item[1] / item[0].weight, item[0].name))
        return ReclaimNeed(short, wanted, [(rec.name, n) for rec, n in excess])

    def _refuse_impossible(self) -> list[tuple[Ticket, Verdict]]:
        """Remove and return the waiting requests that settings just made impossible."""
        refused = []
        for waiter in list(self._waiters.values()):
            rec = waiter.model
            if waiter.n_bytes > self._book.ceiling(rec):
                self._queue.remove(waiter)
                reason = never_reason(rec, waiter.n_bytes)
                refused.append(
                    (waiter.ticket, self._refusal(rec, waiter.n_bytes, reason, queued=False))
                )
        if refused:
            self._queue.compact()
        return refused

    # -- settings -------------------------------------------------------------------------

    def set_budget(self, budget: int) -> list[tuple[Ticket, Verdict]]:
        """Change the budget live. Lowering it below what is held is allowed: nothing is taken
        back, and nothing is granted until holdings are under it. Call :meth:`grants` afterwards
        (raising it may let requests go).

        Returns:
            The waiting requests that can now never be granted, removed from the queue, each
            with its NEVER verdict to answer it with.

        Raises:
            ValueError: Not an int in [1, 2**50], or below the sum of the reserves.
        """
        self._book.set_budget(budget)
        self._settled = False
        return self._refuse_impossible()

    def set_model(
        self, model: str, settings: ModelSettings, *, configured: bool = True
    ) -> list[tuple[Ticket, Verdict]]:
        """Set ``model``'s settings live (it becomes ``configured``: kept when its workers are
        gone; False for settings falling back to the defaults). A limit or reserve below what
        it holds takes nothing back: the model gets nothing more until it is under its limit.
        Call :meth:`grants` afterwards.

        Returns:
            As :meth:`set_budget` (a raised reserve lowers what the other models can ever get).

        Raises:
            ValueError: ``settings`` is not ModelSettings, or the reserves would sum over the
                budget (nothing changed).
        """
        self._book.set_model(model, settings, configured=configured)
        self._settled = False
        return self._refuse_impossible()

    def forget_model(self, model: str) -> bool:
        """Drop an unconfigured model that holds nothing and waits for nothing (its last session
        ended), so names of workers long gone do not pile up. Configured models are kept: their
        settings outlive their workers. Returns whether it was dropped."""
        return self._book.forget(model)

    # -- answers for people ---------------------------------------------------------------

    def fit(
        self,
        model: str,
        bytes_per_sequence: int,
        concurrency: int = 1,
        own_cache: int = 0,
        new_weights: int = 0,
    ) -> FitAnswer:
        """Would ``concurrency`` more sequences of ``bytes_per_sequence`` bytes each fit
        ``model``? (See :class:`FitAnswer` for the verdicts; :func:`bytes_for_context` computes
        ``bytes_per_sequence``.) ``own_cache``: bytes of what the model holds that its workers'
        prompt caches keep idle, counted as available to it now. ``new_weights``: bytes of
        weights a load of the model would add (for a model not loaded yet): its KV gets the
        budget less them. Changes nothing, even for a model never seen.

        Raises:
            ValueError: ``bytes_per_sequence`` or ``concurrency`` is not a positive int, or
                ``own_cache`` is negative.
        """
        for name, value in (
            ("bytes_per_sequence", bytes_per_sequence),
            ("concurrency", concurrency),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name, value in (("own_cache", own_cache), ("new_weights", new_weights)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        return self._book.fit(model, bytes_per_sequence, concurrency, own_cache, new_weights)

    def snapshot(self, now: float | None = None) -> BudgetSnapshot:
        """Everything an operator sees: the budget and, per model, holdings, settings, borrowed
        bytes, entitlement and waiting demand. ``now`` (monotonic) adds waiting ages."""
        return self._book.snapshot(len(self._waiters), now)

    def check_invariants(self) -> None:
        """Recount everything kept incrementally and check the queue against its indices.

        Raises:
            AssertionError: With what disagrees (a bug in this module).
        """
        self._book.check_totals()
        recs = list(self._models.values())
        for rec in recs:
            self._book.check_record(rec)
            self._queue.check_model(rec)
            assert self._models.get(rec.name) is rec
        self._queue.check_indices(recs)


def _policy_key(rec: ModelRecord, head: Waiter) -> tuple[int, float, int]:
    """Sort key of a waiting model: below its reserve first (by arrival of its head), then the
    smallest (held + head) / weight (ties by arrival).

    Counting the head's bytes (the model's holdings once granted, as weighted fair queuing
    orders by finish tag) is what makes hand-outs settle at the weights: by ``held / weight``
    alone, two models at 6 and 3 requests of weights 2 and 1 tie, and arrival order then lets
    the lighter one reach 4 of 10 about half the time (docs/budget.md has the measured shares)."""
    if rec.held < rec.reserve:
        return (0, 0.0, head.seq)
    return (1, (rec.held + head.n_bytes) / rec.weight, head.seq)


def _first(item: tuple[tuple[int, float, int], Waiter]) -> tuple[int, float, int]:
    return item[0]


def _check_amount(n_bytes: int) -> None:
    if type(n_bytes) is not int or not 0 <= n_bytes <= MAX_BYTES:
        raise ValueError(f"a byte count must be an int in [0, {MAX_BYTES}], got {n_bytes!r}")


def _refuse_request_size(n_bytes: object) -> None:
    # A request may ask for any size (a huge one is NEVER, with the numbers); only its type and
    # sign are errors.
    raise ValueError(f"a request must be for an int >= 0 bytes, got {n_bytes!r}")
