"""The reclaim book (daemon/budget/reclaim_book.py), in process: asks never exceed what the ledger
says is short, one open ask per session, the ledger's holdings decide what an answer gave back,
and a late ask is counted, handed to others, and its session left alone for a cool-down."""

from __future__ import annotations

import pytest
from vqpool.daemon.budget.ledger import BudgetLedger, ModelSettings, Outcome
from vqpool.daemon.budget.reclaim_book import ReclaimBook, plan_reclaim
from vqpool.daemon.budget.types import ReclaimNeed


def test_plan_asks_at_most_what_is_short_largest_excess_first() -> None:
    book = ReclaimBook(deadline=1.0)
    need = ReclaimNeed(30, {"a": 30}, [("b", 25), ("c", 20)])
    asks = book.plan(need, {"b": [(1, 15), (2, 20)], "c": [(3, 40)]}, now=0.0)
    assert [(a.sid, a.n_bytes) for a in asks] == [(2, 20), (1, 5), (3, 5)]
    assert book.outstanding == 30
    assert book.plan(need, {"b": [(1, 15), (2, 20)], "c": [(3, 40)]}, now=0.1) == []


def test_answers_count_what_the_ledger_saw_not_what_is_claimed() -> None:
    book = ReclaimBook(deadline=1.0)
    (ask,) = book.plan(ReclaimNeed(10, {"a": 10}, [("b", 10)]), {"b": [(7, 50)]}, now=0.0)
    assert book.answer(8, ask.ask_id, 10, 0, now=0.1) == (None, 0)  # not that session's ask
    answered, freed = book.answer(7, ask.ask_id, 10_000, held_now=44, now=0.2)
    assert answered is ask and freed == 6
    stats = book.stats
    assert (stats.answered, stats.bytes_reclaimed, stats.overclaimed, stats.stale_answers) == (
        1,
        6,
        1,
        1,
    )
    assert stats.latency_quantile(0.5) == pytest.approx(0.2)
    assert book.answer(7, ask.ask_id, 6, 44, now=0.3) == (None, 0)  # answered already


def test_a_late_ask_is_counted_asked_of_others_and_its_session_left_alone() -> None:
    book = ReclaimBook(deadline=1.0)
    need = ReclaimNeed(10, {"a": 10}, [("b", 40)])
    holders = {"b": [(1, 20), (2, 20)]}
    (first,) = book.plan(need, holders, now=0.0)
    assert book.expire(0.5) == [] and book.next_deadline() == 1.0
    assert book.expire(1.0) == [first] and first.late and book.stats.late == 1
    assert book.outstanding == 0
    (second,) = book.plan(need, holders, now=1.0)
    assert second.sid != first.sid
    assert book.open_ask(first.sid) is first  # cool-down: not asked again yet
    book.expire(2.0)
    assert book.open_ask(first.sid) is None
    book.session_ended(second.sid)
    assert book.outstanding == 0


def test_the_ledger_and_the_book_restore_a_lent_reserve() -> None:
    ledger = BudgetLedger(100, {"a": ModelSettings(reserve=50)}, lend_reserves=True)
    assert ledger.try_grant("b", 100).outcome is Outcome.GRANT
    assert ledger.request("a", 30, "t", 5.0, 0.0).queued
    book = ReclaimBook()
    (ask,) = book.plan(ledger.reclaim_need(), {"b": [(1, 100)]}, now=0.0)
    assert ask.n_bytes == 30
    ledger.credit("b", 32)  # the worker freed whole requests
    _, freed = book.answer(1, ask.ask_id, 32, held_now=ledger.held("b"), now=0.01)
    assert freed == 32 and ledger.grants() == ["t"]
    assert ledger.reclaim_need().short == 0


def test_a_bad_deadline_is_refused() -> None:
    for bad in (0, -1, 61):
        with pytest.raises(ValueError):
            ReclaimBook(bad)


# -- hysteresis: the margin below a share, and the cool-down after an answer -------------------


def contended(a_held: int) -> BudgetLedger:
    """Budget 100, weights 1:1, lent reserves of 20 each; a holds ``a_held``, b the rest, and
    a waits with a request of 4."""
    settings = {"a": ModelSettings(reserve=20), "b": ModelSettings(reserve=20)}
    ledger = BudgetLedger(100, settings, lend_reserves=True)
    assert ledger.try_grant("a", a_held).outcome is Outcome.GRANT
    assert ledger.try_grant("b", 100 - a_held).outcome is Outcome.GRANT
    assert ledger.request("a", 4, "t", 5.0, 0.0).queued
    return ledger


def test_a_model_just_below_its_share_is_not_owed_past_the_margin() -> None:
    ledger = contended(46)  # full share 50: 4 short, within a 10% margin (5)
    assert ledger.reclaim_need(margin=0.0).short == 4
    assert ledger.reclaim_need(margin=0.1).short == 0
    # 10 short of its full share (its entitlement, capped at its demand, is 44): owed.
    ledger = contended(40)
    assert ledger.reclaim_need(margin=0.1).short == 4


def test_a_reserve_is_owed_whatever_the_margin() -> None:
    settings = {"a": ModelSettings(reserve=60), "b": ModelSettings()}
    ledger = BudgetLedger(100, settings, lend_reserves=True)
    assert ledger.try_grant("a", 56).outcome is Outcome.GRANT
    assert ledger.try_grant("b", 44).outcome is Outcome.GRANT
    assert ledger.request("a", 4, "t", 5.0, 0.0).queued  # 56 + 4 = its reserve
    assert ledger.reclaim_need(margin=0.5).short == 4


def test_a_bad_margin_is_refused() -> None:
    ledger = contended(40)
    for bad in (-0.1, 1.0, 2):
        with pytest.raises(ValueError, match="margin"):
            ledger.reclaim_need(margin=bad)


def test_a_session_that_answered_is_not_asked_for_shares_within_its_cool_down() -> None:
    book = ReclaimBook(deadline=1.0, cool_down=0.5)
    need = ReclaimNeed(10, {"a": 10}, [("b", 10)])
    (ask,) = book.plan(need, {"b": [(7, 50)]}, now=0.0, cool=True)
    book.answer(7, ask.ask_id, 10, held_now=40, now=0.1)
    assert book.cooling(7, 0.2) and not book.cooling(7, 0.6)
    assert book.plan(need, {"b": [(7, 40)]}, now=0.2, cool=True) == []
    # Another session of the model is asked meanwhile; a reserve's plan ignores the cool-down.
    (other,) = book.plan(need, {"b": [(7, 40), (8, 5)]}, now=0.2, cool=True)
    assert (other.sid, other.n_bytes) == (8, 5)
    (again,) = book.plan(need, {"b": [(7, 40)]}, now=0.3, cool=False)
    assert again.sid == 7
    book.session_ended(7)
    assert not book.cooling(7, 0.3)


def test_plan_reclaim_restores_reserves_at_once_and_shares_only_past_the_cool_down() -> None:
    settings = {"a": ModelSettings(reserve=30), "b": ModelSettings()}
    ledger = BudgetLedger(100, settings, lend_reserves=True)
    assert ledger.try_grant("a", 10).outcome is Outcome.GRANT
    assert ledger.try_grant("b", 90).outcome is Outcome.GRANT
    book = ReclaimBook(deadline=1.0, cool_down=0.5)

    def holders(models: object) -> dict[str, list[tuple[int, int]]]:
        return {"b": [(2, ledger.held("b"))]}

    # a waits for 30 more: 20 of it restores its reserve, 10 is its fair share above it.
    assert ledger.request("a", 20, "r", 5.0, 0.0).queued
    assert ledger.request("a", 10, "s", 5.0, 0.0).queued
    need, asks = plan_reclaim(ledger, book, holders, now=0.0)
    # One open ask per session: the reserve's 20 now, the share's 10 after it is answered.
    assert need.short == 30 and [(a.sid, a.n_bytes) for a in asks] == [(2, 20)]
    # b answers with 20 (its only session had one ask open); a's reserve is back.
    ledger.credit("b", 20)
    book.answer(2, asks[0].ask_id, 20, held_now=ledger.held("b"), now=0.01)
    assert ledger.grants() == ["r"]
    # The rest is a fair share: b is cooling, so nothing is asked until its cool-down ends.
    assert plan_reclaim(ledger, book, holders, now=0.02)[1] == []
    (later,) = plan_reclaim(ledger, book, holders, now=0.6)[1]
    assert (later.sid, later.n_bytes) == (2, 10)
