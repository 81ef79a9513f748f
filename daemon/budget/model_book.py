"""The ledger's book of holdings: bytes each model holds against one budget, under the settings
in effect for it, and the three rules of what may fit.

The book says what each model holds and may hold; who gets bytes next, and who waits, is the
ledger's policy (``budget/ledger.py``), which reads and changes holdings only through here.
Pure bookkeeping: no I/O, no clock (times are passed in).
"""

from __future__ import annotations

from collections.abc import Mapping

from vqpool.daemon.budget.shares import ShareTable, entitlements
from vqpool.daemon.budget.types import (
    DEFAULT_SETTINGS,
    BudgetSnapshot,
    FitAnswer,
    FitVerdict,
    ModelBudgetView,
    ModelSettings,
    Reason,
)
from vqpool.daemon.budget.waiting import ModelRecord
from vqpool.shared.byte_sizes import MAX_BYTES, format_bytes


class ModelBook:
    """Per model, its settings in effect and the bytes it holds, and the totals kept with them.

    A request of ``n`` bytes by model ``m`` fits (:meth:`fits`) when all three hold:

    - ``total_held + total_weights + n <= budget``;
    - ``held(m) + n <= limit(m)`` (its limit, or the budget if smaller);
    - ``n <= budget - total_weights - total_held - protected(others)``, where
      ``protected(others)`` is the sum of ``max(0, reserve - held)`` over the other models: their
      unused reserves are theirs (dropped when reserves are lent).

    Weights (:meth:`set_weights`) are charged beside KV, per holder key; they are not KV:
    reserves and limits bound KV only, and the room for KV is ``kv_budget = budget -
    total_weights`` (the fair shares are shares of it).

    Attributes (read freely; changed only by the methods):
        budget: Bytes all models may hold together.
        total_held: Bytes of KV held in all.
        total_weights: Bytes of weights charged in all.
        reserved: The sum of the reserves.
        protected: The unused reserves: sum of ``max(0, reserve - held)`` over the models.
        lend_reserves: Whether grants may take unused reserves.
        models: The records by model name (the same dict for the book's life).

    Raises:
        ValueError: A bad budget, a model whose settings are not :class:`ModelSettings`, or
            reserves summing over the budget.
    """

    def __init__(
        self, budget: int, models: Mapping[str, ModelSettings] | None, lend_reserves: bool
    ) -> None:
        check_budget(budget)
        configured = dict(models or {})
        for name, settings in configured.items():
            check_model_name(name)
            if not isinstance(settings, ModelSettings):
                raise ValueError(
                    f"model {name!r}: settings must be ModelSettings, got {settings!r}"
                )
        reserved = sum(s.reserve for s in configured.values())
        if reserved > budget:
            raise ValueError(_reserves_over_budget(reserved, budget))
        self.budget = budget
        self.models: dict[str, ModelRecord] = {}
        self.total_held = 0
        self.total_weights = 0
        self.reserved = reserved
        self.protected = reserved  # nothing is held yet: every reserve is unused
        self.lend_reserves = bool(lend_reserves)
        self.version = 0
        """Bumped by every change of holdings or settings (what the fair shares depend on)."""
        for name, settings in configured.items():
            model = self.models[name] = ModelRecord(name, settings, budget)
            model.configured = True

    # -- reading -------------------------------------------------------------------------------

    @property
    def kv_budget(self) -> int:
        """The room for KV: the budget less the weights charged (negative when weights alone
        are over the budget: then nothing is granted)."""
        return self.budget - self.total_weights

    def held(self, model: str) -> int:
        """Bytes ``model`` holds (0 for a model never seen)."""
        found = self.models.get(model)
        return 0 if found is None else found.held

    def settings_of(self, model: str) -> ModelSettings:
        """The settings in effect for ``model`` (the defaults for an unconfigured one)."""
        found = self.models.get(model)
        return DEFAULT_SETTINGS if found is None else found.settings

    def record(self, name: str) -> ModelRecord:
        """The record of ``name``, created with the default settings on first use."""
        found = self.models.get(name)
        if found is None:
            check_model_name(name)
            found = self.models[name] = ModelRecord(name, DEFAULT_SETTINGS, self.budget)
            self.version += 1
        return found

    # -- holdings ------------------------------------------------------------------------------

    def add(self, model: ModelRecord, n_bytes: int) -> None:
        """Holdings of ``model`` += ``n_bytes`` (either sign), keeping the total and the sum of
        unused reserves current without looking at any other model."""
        held = model.held
        reserve = model.reserve
        unused_before = reserve - held if held < reserve else 0
        held += n_bytes
        model.held = held
        self.total_held += n_bytes
        self.protected += (reserve - held if held < reserve else 0) - unused_before
        self.version += 1

    def take(self, rec: ModelRecord, n_bytes: int) -> bool:
        """Add ``n_bytes`` to ``rec``'s holdings if they fit; whether they did (the three rules,
        inlined: the hot path of a grant while nobody waits)."""
        held = rec.held
        if held + n_bytes <= rec.limit:
            reserve = rec.reserve
            unused_own = reserve - held if held < reserve else 0
            protected = 0 if self.lend_reserves else self.protected - unused_own
            if n_bytes <= self.budget - self.total_weights - self.total_held - protected:
                held += n_bytes
                rec.held = held
                self.total_held += n_bytes
                self.protected += (reserve - held if held < reserve else 0) - unused_own
                self.version += 1
                return True
        return False

    def set_weights(self, rec: ModelRecord, key: object, n_bytes: int) -> int:
        """Charge ``n_bytes`` of weights to ``rec`` under holder ``key`` (0 removes the key),
        unconditionally (a measurement may take the total over the budget: then nothing is
        granted until under). Returns the change in bytes."""
        before = rec.weight_keys.get(key, 0)
        if n_bytes:
            rec.weight_keys[key] = n_bytes
        else:
            rec.weight_keys.pop(key, None)
        change = n_bytes - before
        rec.weights += change
        self.total_weights += change
        if change:
            self.version += 1
        return change

    # -- the rules -----------------------------------------------------------------------------

    def fits(self, rec: ModelRecord, n_bytes: int) -> bool:
        """The three rules (budget, own limit, others' unused reserves), queue aside."""
        return (
            rec.held + n_bytes <= rec.limit
            and n_bytes <= self.kv_budget - self.total_held - self.protected_from(rec)
        )

    def protected_from(self, rec: ModelRecord) -> int:
        """Unused reserves of the models other than ``rec`` that it may not take (none when
        reserves are lent)."""
        if self.lend_reserves:
            return 0
        held, reserve = rec.held, rec.reserve
        return self.protected - (reserve - held if held < reserve else 0)

    def ceiling(self, rec: ModelRecord) -> int:
        """The most KV ``rec`` could ever hold: min(limit, budget - its own weights - other
        models' reserves), or its limit less what its weights take of the budget when reserves
        are lent (what it holds beyond the first may be taken back). Other models' weights do
        not lower it: they go when those models are unloaded."""
        own_room = self.budget - rec.weights
        if self.lend_reserves:
            return max(0, min(rec.limit, own_room))
        return max(0, min(rec.limit, own_room - (self.reserved - rec.reserve)))

    def shortage(self, rec: ModelRecord, n_bytes: int) -> Reason:
        """Why ``n_bytes`` does not go to ``rec`` now (BEHIND_WAITERS if it would fit)."""
        held = rec.held
        if held + n_bytes > rec.limit:
            return Reason.OWN_LIMIT
        free = self.kv_budget - self.total_held
        if n_bytes > free:
            return Reason.BUDGET_FULL
        if n_bytes > free - self.protected_from(rec):
            return Reason.RESERVES_PROTECTED
        return Reason.BEHIND_WAITERS

    def entitlements(self, wanting_all: ModelRecord | None = None) -> dict[ModelRecord, float]:
        """Each model's fair share now (see :func:`~vqpool.daemon.budget.shares.entitlements`)."""
        return entitlements(
            self.models.values(), max(0, self.kv_budget), self.lend_reserves, wanting_all
        )

    def share_table(self) -> ShareTable:
        """The fair shares now, with each model's full share (see :class:`ShareTable`)."""
        return ShareTable(self.models.values(), max(0, self.kv_budget), self.lend_reserves)

    # -- settings ------------------------------------------------------------------------------

    def set_budget(self, budget: int) -> None:
        """Change the budget (see :meth:`BudgetLedger.set_budget`).

        Raises:
            ValueError: Not an int in [1, 2**50], or below the sum of the reserves.
        """
        check_budget(budget)
        if self.reserved > budget:
            raise ValueError(_reserves_over_budget(self.reserved, budget))
        self.budget = budget
        for rec in self.models.values():
            limit = rec.settings.limit
            rec.limit = budget if limit is None else min(limit, budget)
        self.version += 1

    def set_model(self, model: str, settings: ModelSettings, *, configured: bool = True) -> None:
        """Set ``model``'s settings (see :meth:`BudgetLedger.set_model`).

        Raises:
            ValueError: ``settings`` is not ModelSettings, or the reserves would sum over the
                budget (nothing changed).
        """
        check_model_name(model)
        if not isinstance(settings, ModelSettings):
            raise ValueError(f"model {model!r}: settings must be ModelSettings, got {settings!r}")
        found = self.models.get(model)
        old_reserve = 0 if found is None else found.reserve
        reserved = self.reserved - old_reserve + settings.reserve
        if reserved > self.budget:
            raise ValueError(_reserves_over_budget(reserved, self.budget, model))
        rec = self.record(model) if found is None else found
        held = rec.held
        unused_before = old_reserve - held if held < old_reserve else 0
        rec.settings = settings
        rec.configured = configured
        rec.reserve = settings.reserve
        rec.limit = self.budget if settings.limit is None else min(settings.limit, self.budget)
        rec.weight = float(settings.weight)
        self.reserved = reserved
        self.protected += (rec.reserve - held if held < rec.reserve else 0) - unused_before
        self.version += 1

    def forget(self, model: str) -> bool:
        """Drop ``model`` if unconfigured, holding nothing and waiting for nothing (see
        :meth:`BudgetLedger.forget_model`); whether it was dropped."""
        found = self.models.get(model)
        if found is None or found.configured or found.held or found.queue or found.weights:
            return False
        del self.models[model]
        self.version += 1
        return True

    # -- answers for people --------------------------------------------------------------------

    def fit(
        self,
        model: str,
        bytes_per_sequence: int,
        concurrency: int,
        own_cache: int = 0,
        new_weights: int = 0,
    ) -> FitAnswer:
        """See :meth:`BudgetLedger.fit` (the arguments are checked there)."""
        found = self.models.get(model)
        rec = ModelRecord(model, DEFAULT_SETTINGS, self.budget) if found is None else found
        need = bytes_per_sequence * concurrency
        held = rec.held
        cache = min(own_cache, held)  # its cache's bytes are among what it holds
        others_protected = self.protected_from(rec)

        kv_budget = self.kv_budget - new_weights

        def grantable(held_now: int) -> int:
            total = self.total_held - held + held_now
            return max(0, min(rec.limit - held_now, kv_budget - total - others_protected))

        without_cache = grantable(held)
        available_now = grantable(held - cache) if cache else without_cache
        others_reserves = self.reserved - rec.reserve
        kept = held - cache  # what it holds once its cache is given back
        own_room = self.budget - rec.weights - new_weights
        after_return = max(0, min(rec.limit - kept, own_room - kept - others_reserves))
        most_ever = max(0, self.ceiling(rec) - new_weights)
        verdict: FitVerdict
        if need <= available_now:
            verdict = "now"
        elif need <= rec.reserve:
            verdict = "within_reserve"
        elif need <= most_ever:
            verdict = "after_others_return"
        else:
            verdict = "never"
        return FitAnswer(
            verdict,
            need,
            held,
            available_now,
            after_return,
            most_ever,
            rec.reserve,
            rec.limit,
            available_now // bytes_per_sequence,
            most_ever // bytes_per_sequence,
            available_now - without_cache,
        )

    def snapshot(self, waiting: int, now: float | None) -> BudgetSnapshot:
        """See :meth:`BudgetLedger.snapshot`; ``waiting``: the requests waiting in all."""
        entitlement = self.entitlements()
        protected = self.protected
        lent = min(protected, max(0, self.total_held + protected - self.kv_budget))
        models = {}
        for name, rec in self.models.items():
            oldest = None
            if rec.queue and now is not None:
                oldest = max(0.0, now - rec.head().enqueued_at)
            models[name] = ModelBudgetView(
                held=rec.held,
                weights=rec.weights,
                reserve=rec.reserve,
                limit=rec.settings.limit,
                effective_limit=rec.limit,
                weight=rec.weight,
                borrowed=max(0, rec.held - rec.reserve),
                entitlement=int(entitlement.get(rec, 0.0)),
                waiting=len(rec.queue),
                waiting_bytes=rec.waiting_bytes,
                oldest_wait_s=oldest,
                configured=rec.configured,
                lent=lent * max(0, rec.reserve - rec.held) // protected if lent else 0,
            )
        return BudgetSnapshot(
            budget=self.budget,
            total_held=self.total_held,
            total_weights=self.total_weights,
            free=max(0, self.kv_budget - self.total_held),
            over_budget=max(0, self.total_held - self.kv_budget),
            reserved=self.reserved,
            protected=self.protected,
            waiting=waiting,
            models=models,
            lend_reserves=self.lend_reserves,
            lent=lent,
        )

    def check_totals(self) -> None:
        """Recount the totals kept incrementally.

        Raises:
            AssertionError: With what disagrees (a bug in this module).
        """
        recs = list(self.models.values())
        total = sum(r.held for r in recs)
        assert self.total_held == total, f"total_held {self.total_held} != sum of held {total}"
        weights = sum(r.weights for r in recs)
        assert self.total_weights == weights, f"total_weights {self.total_weights} != {weights}"
        reserved = sum(r.reserve for r in recs)
        assert self.reserved == reserved, f"reserved {self.reserved} != sum of reserves {reserved}"
        assert reserved <= self.budget, f"reserves {reserved} over the budget {self.budget}"
        protected = sum(max(0, r.reserve - r.held) for r in recs)
        assert self.protected == protected, f"protected {self.protected} != recount {protected}"

    def check_record(self, rec: ModelRecord) -> None:
        """Check ``rec``'s holdings and settings in effect.

        Raises:
            AssertionError: With what disagrees.
        """
        assert rec.held >= 0, f"model {rec.name!r} holds {rec.held} bytes"
        assert rec.weights == sum(rec.weight_keys.values()), f"{rec.name!r}: weights recount"
        assert all(n > 0 for n in rec.weight_keys.values()), f"{rec.name!r}: a weight <= 0"
        s = rec.settings
        assert (rec.reserve, rec.weight) == (s.reserve, float(s.weight)), rec.name
        want_limit = self.budget if s.limit is None else min(s.limit, self.budget)
        assert rec.limit == want_limit, f"{rec.name!r}: limit {rec.limit} != {want_limit}"


def never_reason(rec: ModelRecord, n_bytes: int) -> Reason:
    """Why ``n_bytes`` can never go to ``rec``: over its limit, or over its ceiling."""
    return Reason.OVER_LIMIT if n_bytes > rec.limit else Reason.OVER_CEILING


def check_budget(budget: int) -> None:
    if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= MAX_BYTES:
        raise ValueError(f"budget must be an int in [1, {MAX_BYTES}] bytes, got {budget!r}")


def check_model_name(name: str) -> None:
    if not isinstance(name, str):
        raise ValueError(f"a model name must be a str, got {name!r}")


def _reserves_over_budget(reserved: int, budget: int, model: str | None = None) -> str:
    which = f" with model {model!r}'s new reserve" if model is not None else ""
    return (
        f"the reserves{which} sum to {format_bytes(reserved)}, over the budget "
        f"{format_bytes(budget)}: lower some reserves or raise the budget"
    )
