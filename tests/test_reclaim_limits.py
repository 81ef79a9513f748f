"""Reclaim for a limit lowered below what its model holds (daemon/budget/reclaim_book.py,
``plan_limits``), in process: the model's own sessions are asked for what it holds above its
limit, never another model's, and nothing more once it is back under it."""

from __future__ import annotations

from vqpool.daemon.budget.ledger import BudgetLedger, ModelSettings, Outcome
from vqpool.daemon.budget.reclaim_book import ReclaimBook, plan_limits

HOLDERS = {"m": [(1, 70), (2, 30)], "o": [(3, 200)]}


def holders(models: object) -> dict[str, list[tuple[int, int]]]:
    return {model: HOLDERS[model] for model in HOLDERS if model in models}  # type: ignore[operator]


def test_a_model_above_its_lowered_limit_is_asked_for_the_excess_of_its_own_sessions() -> None:
    ledger = BudgetLedger(1000)
    for model, n in (("m", 100), ("o", 200)):
        assert ledger.try_grant(model, n).outcome is Outcome.GRANT
    ledger.set_model("m", ModelSettings(limit=40))
    assert ledger.request("m", 20, "t", 30.0, 0.0).queued  # waits for m's own bytes
    book = ReclaimBook(deadline=1.0)
    over_limit = {"m"}
    asks = plan_limits(ledger, book, over_limit, holders, now=0.0)
    assert [(a.sid, a.model, a.n_bytes) for a in asks] == [(1, "m", 60)]  # o is never asked
    assert plan_limits(ledger, book, over_limit, holders, now=0.1) == []  # asked already
    book.answer(1, asks[0].ask_id, 60, 10, now=0.2)
    ledger.credit("m", 60)
    assert plan_limits(ledger, book, over_limit, holders, now=1.0) == []  # at its limit
    assert over_limit == set()
    # Room for its request comes from its own cache too (the cache advice), not by reclaim.
    assert ledger.grants() == []
    ledger.credit("m", 20)
    assert ledger.grants() == ["t"]


def test_a_model_within_its_limit_leaves_the_set_unasked() -> None:
    ledger = BudgetLedger(1000)
    assert ledger.try_grant("m", 30).outcome is Outcome.GRANT
    over_limit = {"m", "never-seen"}
    assert plan_limits(ledger, ReclaimBook(), over_limit, holders, now=0.0) == []
    assert over_limit == set()
