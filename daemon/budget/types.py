"""What the byte budget ledger (``daemon/budget/ledger.py``) takes and gives: per-model settings,
the verdict on a request, the answer to "will it fit?", and the snapshot an operator reads.

All sizes are bytes. See ``docs/budget.md`` for the rules behind them.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Literal

from vqpool.shared.byte_sizes import MAX_BYTES, format_bytes

Ticket = Hashable
"""Whatever the caller uses to find a waiting request again (a request id, a tuple)."""

MIN_WEIGHT = 0.001
MAX_WEIGHT = 1000.0
"""Weights outside [0.001, 1000] are refused: a million-to-one share is already beyond any use,
and it keeps held/weight comparisons well inside float precision."""


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """What an operator sets for one model (TOML ``[models."NAME"]`` or ``vqpoolctl model set``).

    Attributes:
        reserve: Bytes kept for this model: other models never get them, whether or not this
            model uses them (0: no floor).
        limit: Most bytes this model may hold (None: the budget). A limit above the budget is
            kept as given and acts as the budget: the budget may be a percentage of memory or be
            changed live, and a limit that was right on a larger machine must not make a
            configuration invalid.
        weight: How spare bytes are shared between models that want more (default 1; in
            [0.001, 1000]).

    Raises:
        ValueError: A value of the wrong type, out of range, or ``reserve > limit``.
    """

    reserve: int = 0
    limit: int | None = None
    weight: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.reserve, bool) or not isinstance(self.reserve, int):
            raise ValueError(f"reserve must be a number of bytes, got {self.reserve!r}")
        if not 0 <= self.reserve <= MAX_BYTES:
            raise ValueError(f"reserve must be in [0, {MAX_BYTES}] bytes, got {self.reserve}")
        if self.limit is not None:
            if isinstance(self.limit, bool) or not isinstance(self.limit, int):
                raise ValueError(f"limit must be a number of bytes or None, got {self.limit!r}")
            if not 0 <= self.limit <= MAX_BYTES:
                raise ValueError(f"limit must be in [0, {MAX_BYTES}] bytes, got {self.limit}")
            if self.reserve > self.limit:
                raise ValueError(
                    f"reserve {format_bytes(self.reserve)} is over the limit "
                    f"{format_bytes(self.limit)}: a model cannot be kept more than it may hold"
                )
        weight = self.weight
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise ValueError(f"weight must be a number, got {weight!r}")
        if not (math.isfinite(weight) and MIN_WEIGHT <= weight <= MAX_WEIGHT):
            raise ValueError(f"weight must be in [{MIN_WEIGHT}, {MAX_WEIGHT:g}], got {weight!r}")


DEFAULT_SETTINGS = ModelSettings()
"""An unconfigured model: no reserve, the budget as its limit, weight 1."""


class Outcome(enum.Enum):
    """What happened to a request."""

    GRANT = "grant"
    """The bytes are charged to the model: hand the blocks out."""
    WAIT = "wait"
    """Not now. ``Verdict.queued`` says whether it waits in the queue (then :meth:`grants`
    names its ticket once it is charged) or was answered at once (``try_grant``, a past
    deadline)."""
    NEVER = "never"
    """It can never be granted with the current settings: not queued."""
    QUEUE_FULL = "queue_full"
    """It would have to wait, but too many requests already wait: not queued."""


class Reason(enum.Enum):
    """Why a request waits or is refused."""

    BUDGET_FULL = "budget_full"
    """Fewer free bytes in the budget than the request needs (or the budget was lowered below
    what is held)."""
    OWN_LIMIT = "own_limit"
    """The model holds so much that the request would take it over its limit; it waits for its
    own bytes to be freed and holds no other model up."""
    RESERVES_PROTECTED = "reserves_protected"
    """The bytes are free but belong to other models' unused reserves."""
    BEHIND_WAITERS = "behind_waiters"
    """It would fit, but requests the policy serves first wait (this model's earlier ones, or a
    model with a smaller share whose request does not fit yet)."""
    OVER_LIMIT = "over_limit"
    """(NEVER) The request alone is over the model's limit."""
    OVER_CEILING = "over_ceiling"
    """(NEVER) The request alone is over the budget minus the other models' reserves."""
    MODEL_QUEUE_FULL = "model_queue_full"
    """(QUEUE_FULL) The model has as many waiting requests as allowed."""
    ALL_QUEUES_FULL = "all_queues_full"
    """(QUEUE_FULL) As many requests wait in all as allowed."""
    ABOVE_SHARE = "above_share"
    """A growth that does not fit now and would take its model above its fair share (its
    entitlement): it is not queued, since nothing would be taken back for it; the worker
    preempts one of its own requests instead."""
    GROWTH_WAITING = "growth_waiting"
    """A growth whose session already has a growth waiting (one at a time per session): it is
    answered at once, as with ``wait`` 0."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """The answer to one request, with the numbers behind it (bytes) for a clear message.

    The granted fast path returns the shared :data:`GRANTED` constant, whose numbers are all 0:
    test ``verdict.outcome is Outcome.GRANT``, and read numbers only from other verdicts.

    Attributes:
        outcome: What happened.
        reason: Why it waits or was refused (None when granted).
        queued: Whether the request now waits in the queue.
        model: The requesting model.
        n_bytes: Bytes asked for.
        held: Bytes the model held when answered.
        limit: The model's limit in effect (its limit, or the budget if smaller).
        ceiling: The most the model could ever hold: min(limit, budget - others' reserves).
        budget: The budget.
        total_held: Bytes held by all models.
        protected: Bytes of other models' unused reserves (off limits to this model).
        total_weights: Bytes of weights charged to all models (beside ``total_held``).
    """

    outcome: Outcome
    reason: Reason | None
    queued: bool = False
    model: str = ""
    n_bytes: int = 0
    held: int = 0
    limit: int = 0
    ceiling: int = 0
    budget: int = 0
    total_held: int = 0
    protected: int = 0
    total_weights: int = 0

    def message(self) -> str:
        """One sentence for a log line or an error reply."""
        fb = format_bytes
        need = f"{fb(self.n_bytes)} for model {self.model!r}"
        free = max(0, self.budget - self.total_held - self.total_weights)
        held = fb(self.total_held)
        if self.total_weights:
            held = f"{held} of KV and {fb(self.total_weights)} of weights"
        reason = self.reason
        if self.outcome is Outcome.GRANT:
            return f"granted {need}"
        if reason is Reason.BUDGET_FULL:
            return (
                f"{need}: the budget ({fb(self.budget)}) has {fb(free)} free "
                f"({held} held); waiting for bytes to be freed"
            )
        if reason is Reason.OWN_LIMIT:
            return (
                f"{need}: the model holds {fb(self.held)} of its {fb(self.limit)} limit; "
                "waiting for it to free some"
            )
        if reason is Reason.RESERVES_PROTECTED:
            return (
                f"{need}: {fb(free)} is free but {fb(self.protected)} of it is other models' "
                "unused reserve; waiting for bytes to be freed"
            )
        if reason is Reason.BEHIND_WAITERS:
            return f"{need}: queued behind requests that the fair-share order serves first"
        if reason is Reason.OVER_LIMIT:
            return f"{need} is over the model's limit ({fb(self.limit)}): it can never be granted"
        if reason is Reason.OVER_CEILING:
            return (
                f"{need} is more than the model can ever get ({fb(self.ceiling)}: the budget "
                f"{fb(self.budget)} minus its weights and other models' reserves): it can never "
                "be granted"
            )
        if reason is Reason.MODEL_QUEUE_FULL:
            return f"{need}: too many of this model's requests already wait for memory; retry later"
        if reason is Reason.ALL_QUEUES_FULL:
            return f"{need}: too many requests already wait for memory; retry later"
        if reason is Reason.ABOVE_SHARE:
            return (
                f"{need}: a growth that would take the model above its fair share while the "
                f"budget ({fb(self.budget)}, {fb(free)} free) is contended; not queued"
            )
        if reason is Reason.GROWTH_WAITING:
            return f"{need}: this session already has a growth waiting; not queued"
        raise AssertionError(f"no message for {self.outcome} {reason}")


GRANTED = Verdict(Outcome.GRANT, None)
"""The verdict of every immediate grant (one shared object: the hot path allocates nothing)."""

FitVerdict = Literal["now", "within_reserve", "after_others_return", "never"]
"""The answers of ``BudgetLedger.fit``, best first (see :class:`FitAnswer`)."""


@dataclass(frozen=True, slots=True)
class FitAnswer:
    """Whether ``concurrency`` more sequences of a given size fit a model (bytes throughout).

    Attributes:
        verdict: The first that holds, in this order:
            ``"now"``: the bytes are free for this model right now (requests already waiting
            may still be served first).
            ``"within_reserve"``: not free now, but within the model's reserve: no other model
            can keep these bytes from it; what is in the way is the model's own holdings (or
            bytes lent out before its reserve was raised).
            ``"after_others_return"``: fits once other models give back the bytes they hold
            above their reserves (and, if ``need > available_after_return``, once this model's
            own running sequences end too).
            ``"never"``: over the model's limit, or over the budget minus the other models'
            reserves, even with the model holding nothing.
        need: bytes_per_sequence x concurrency.
        held: Bytes the model holds now.
        available_now: Bytes the model could be granted now, its own idle prompt cache
            counted (the cache's bytes are ended requests' KV, which its workers give back
            before a request of theirs waits).
        available_after_return: Bytes it could be granted, on top of what it holds (less its
            own prompt cache), once every other model is back within its reserve.
        most_ever: The most it could ever hold: min(limit, budget - other models' reserves).
        reserve: Its reserve.
        limit: Its limit in effect.
        max_concurrency_now: Sequences of this size that fit in ``available_now``.
        max_concurrency_ever: Sequences of this size that fit in ``most_ever``.
        own_cache_now: How much of ``available_now`` is the model's own prompt cache (0 when
            its workers report none).
    """

    verdict: FitVerdict
    need: int
    held: int
    available_now: int
    available_after_return: int
    most_ever: int
    reserve: int
    limit: int
    max_concurrency_now: int
    max_concurrency_ever: int
    own_cache_now: int = 0


@dataclass(frozen=True, slots=True)
class ModelBudgetView:
    """One model's line in :meth:`BudgetLedger.snapshot` (bytes throughout).

    Attributes:
        held: Bytes its blocks take (KV).
        weights: Bytes of its loaded weights (beside ``held``; not bound by reserve or limit).
        reserve, limit, weight: Its settings (``limit`` None: no limit of its own).
        effective_limit: The limit in effect: min(limit, budget).
        borrowed: Bytes held above its reserve: max(0, held - reserve).
        entitlement: Its fair share of the budget for the current demand (held + waiting bytes
            of every model), by weighted water-filling: each model first gets min(demand,
            reserve); the rest of the budget, less the reserves that sit idle (no model but
            their own gets those), is spread by weight up to min(demand, limit). Bytes held
            above it are what a later reclaim would ask back first.
        waiting: Requests of this model waiting for bytes.
        waiting_bytes: Bytes those requests ask for.
        oldest_wait_s: Seconds its oldest waiting request has waited (None: none waits, or no
            ``now`` was given).
        configured: Whether an operator set its settings (else the defaults apply).
        lent: Bytes of its unused reserve that other models hold on loan (only when the ledger
            lends reserves): the unused reserves' shortfall of free bytes, shared out in
            proportion to each model's unused reserve. Reclaim gives them back on demand.
    """

    held: int
    reserve: int
    limit: int | None
    effective_limit: int
    weight: float
    borrowed: int
    entitlement: int
    waiting: int
    waiting_bytes: int
    oldest_wait_s: float | None
    configured: bool
    lent: int = 0
    weights: int = 0


@dataclass(frozen=True, slots=True)
class BudgetSnapshot:
    """The whole budget at one moment (bytes throughout).

    Attributes:
        budget: The budget.
        total_held: Bytes of KV held by all models.
        total_weights: Bytes of weights charged to all models.
        free: Bytes not held: max(0, budget - total_weights - total_held).
        over_budget: Bytes held beyond the budget after it was lowered (or weights measured
            larger): max(0, total_held + total_weights - budget).
        reserved: Sum of all reserves.
        protected: Unused reserves: sum of max(0, reserve - held).
        waiting: Requests waiting in all.
        models: Per model name.
        lend_reserves: Whether unused reserves may be lent (see ``docs/budget.md``).
        lent: Unused reserve bytes held by other models on loan:
            min(protected, max(0, total_held + total_weights + protected - budget)).
    """

    budget: int
    total_held: int
    free: int
    over_budget: int
    reserved: int
    protected: int
    waiting: int
    models: dict[str, ModelBudgetView]
    lend_reserves: bool = False
    lent: int = 0
    total_weights: int = 0


@dataclass(frozen=True, slots=True)
class ReclaimNeed:
    """What :meth:`BudgetLedger.reclaim_need` says must be taken back, and from whom.

    Attributes:
        short: Bytes missing for the waiting demand the policy owes now (each waiting model's
            queue prefix that fits within its entitlement) plus the bytes held over the budget;
            0 when nothing needs taking back.
        wanted: Per waiting model, the bytes of that queue prefix (only models owed something).
        excess: Models holding more than their entitlement, with ``held - entitlement`` bytes,
            largest ``excess / weight`` first: the order to ask them back in. A model at or
            below its reserve never appears (its entitlement covers what it holds).
    """

    short: int
    wanted: dict[str, int]
    excess: list[tuple[str, int]]


class LoadOutcome(enum.Enum):
    """What :meth:`BudgetLedger.reserve_load` answers for a model about to be loaded."""

    GRANT = "grant"
    """Its weights are charged under the reservation's key: start the worker."""
    SHORT = "short"
    """Not now: ``short`` bytes must be freed first (caches, idle models), or waited for."""
    NEVER = "never"
    """It could not fit even with every other model unloaded and its KV given back."""


@dataclass(frozen=True, slots=True)
class LoadVerdict:
    """The answer to a load reservation, with the numbers behind it (bytes).

    Attributes:
        outcome: What happened.
        model: The model to load.
        weights: Its weights' bytes.
        kv_min: The KV it needs at least (one request at its smallest, or its reserve).
        free: Bytes free for it now: budget - weights - KV held - other models' unused reserves.
        short: Bytes missing now (0 when granted): weights + kv_min - free.
        budget: The budget.
        others_reserved: The reserves of the other models.
        limit: The model's limit in effect (kv_min over it can never fit).
    """

    outcome: LoadOutcome
    model: str
    weights: int
    kv_min: int
    free: int
    short: int
    budget: int
    others_reserved: int
    limit: int

    def message(self, overhead: int = 0) -> str:
        """One sentence for a log line or an error reply; ``overhead``: the part of
        :attr:`weights` that is the worker's overhead (named apart)."""
        fb = format_bytes
        fixed = f"{fb(self.weights)} of weights"
        if overhead:
            fixed = f"{fb(self.weights - overhead)} of weights, {fb(overhead)} of overhead"
        need = f"loading {self.model} needs {fixed} and {fb(self.kv_min)} of KV"
        if self.outcome is LoadOutcome.GRANT:
            return f"{need}: granted"
        if self.outcome is LoadOutcome.SHORT:
            return f"{need}; {fb(self.free)} free now, {fb(self.short)} short"
        if self.kv_min > self.limit:
            return f"{need}; its limit is {fb(self.limit)}: it can never fit"
        return (
            f"{need}; the budget is {fb(self.budget)} and other models reserve "
            f"{fb(self.others_reserved)}: it can never fit"
        )
