"""The reclaim book (daemon/reclaim.py), in process: asks never exceed what the ledger says is
short, one open ask per session, the ledger's holdings decide what an answer gave back, and a
late ask is counted, handed to others, and its session left alone for a cool-down."""

from __future__ import annotations

import pytest
from vqpool.daemon.budget import BudgetLedger, ModelSettings, Outcome
from vqpool.daemon.budget_types import ReclaimNeed
from vqpool.daemon.reclaim import ReclaimBook


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
