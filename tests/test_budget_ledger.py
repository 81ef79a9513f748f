"""The byte budget ledger (daemon/budget/ledger.py): each grant rule and refusal, the waiting
queue's policy, live setting changes, "will it fit?", and a model-based test of all of them
together."""

from __future__ import annotations

import math
import random
from collections import defaultdict, deque
from collections.abc import Hashable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from vqpool.daemon.budget.ledger import (
    DEFAULT_SETTINGS,
    GRANTED,
    BudgetLedger,
    LoadOutcome,
    ModelSettings,
    Outcome,
    Reason,
    bytes_for_context,
    water_fill,
)

GiB = 2**30


def state_of(ledger: BudgetLedger) -> Any:
    """Everything observable, to show a refusal changed nothing."""
    return (ledger.snapshot(now=0.0), ledger.next_deadline())


# -- settings -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"reserve": -1}, "reserve must be in"),
        ({"reserve": 1.5}, "reserve must be a number of bytes"),
        ({"reserve": True}, "reserve must be a number of bytes"),
        ({"reserve": 2**51}, "reserve must be in"),
        ({"limit": -1}, "limit must be in"),
        ({"limit": "8GiB"}, "limit must be a number of bytes or None"),
        ({"reserve": 10, "limit": 5}, "is over the limit"),
        ({"weight": 0}, "weight must be in"),
        ({"weight": -1}, "weight must be in"),
        ({"weight": 1e9}, "weight must be in"),
        ({"weight": math.nan}, "weight must be in"),
        ({"weight": math.inf}, "weight must be in"),
        ({"weight": "2"}, "weight must be a number"),
        ({"weight": True}, "weight must be a number"),
    ],
)
def test_model_settings_refuse_bad_values(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelSettings(**kwargs)


def test_ledger_refuses_bad_configuration() -> None:
    with pytest.raises(ValueError, match="budget must be an int"):
        BudgetLedger(0)
    with pytest.raises(ValueError, match="budget must be an int"):
        BudgetLedger(2**51)
    with pytest.raises(ValueError, match="budget must be an int"):
        BudgetLedger(True)
    with pytest.raises(ValueError, match=r"reserves sum to 9 GiB, over the budget 8 GiB"):
        BudgetLedger(8 * GiB, {"a": ModelSettings(5 * GiB), "b": ModelSettings(4 * GiB)})
    with pytest.raises(ValueError, match="settings must be ModelSettings"):
        BudgetLedger(100, {"a": {"reserve": 1}})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="max_waiting must be"):
        BudgetLedger(100, max_waiting=-1)


def test_limit_over_the_budget_acts_as_the_budget() -> None:
    ledger = BudgetLedger(100, {"a": ModelSettings(limit=1000)})
    view = ledger.snapshot().models["a"]
    assert (view.limit, view.effective_limit) == (1000, 100)
    ledger.set_budget(2000)
    assert ledger.snapshot().models["a"].effective_limit == 1000


def test_unconfigured_models_get_the_defaults() -> None:
    ledger = BudgetLedger(100)
    assert ledger.settings_of("new") == DEFAULT_SETTINGS
    assert ledger.try_grant("new", 100) is GRANTED
    view = ledger.snapshot().models["new"]
    assert (view.reserve, view.limit, view.effective_limit, view.weight) == (0, None, 100, 1.0)
    assert not view.configured


# -- holdings -----------------------------------------------------------------------------


def test_charge_and_credit() -> None:
    ledger = BudgetLedger(100)
    ledger.charge("a", 30)
    ledger.charge("b", 90)  # unconditional: claims of blocks already held may exceed the budget
    assert (ledger.held("a"), ledger.held("b"), ledger.total_held) == (30, 90, 120)
    ledger.credit("b", 90)
    ledger.credit("a", 0)
    ledger.credit("never-seen", 0)
    assert (ledger.held("a"), ledger.held("b"), ledger.total_held) == (30, 0, 30)
    ledger.check_invariants()


def test_credit_beyond_holdings_is_refused_and_changes_nothing() -> None:
    ledger = BudgetLedger(100, {"a": ModelSettings(reserve=10)})
    ledger.charge("a", 5)
    before = state_of(ledger)
    with pytest.raises(ValueError, match="which holds only 5"):
        ledger.credit("a", 6)
    with pytest.raises(ValueError, match="which holds only 0"):
        ledger.credit("ghost", 1)
    for bad in (-1, 1.0, True, None):
        with pytest.raises(ValueError, match="byte count must be an int"):
            ledger.credit("a", bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="byte count must be an int"):
            ledger.charge("a", bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="request must be for an int"):
            ledger.try_grant("a", bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="request must be for an int"):
            ledger.request("new", bad, "t", 9.0, 0.0)  # type: ignore[arg-type]
    assert state_of(ledger) == before
    ledger.check_invariants()


# -- the grant rules ----------------------------------------------------------------------


def test_grant_within_budget_limit_and_others_reserves() -> None:
    ledger = BudgetLedger(100, {"a": ModelSettings(reserve=20), "b": ModelSettings(limit=50)})
    assert ledger.try_grant("b", 50) is GRANTED
    assert ledger.try_grant("c", 30) is GRANTED  # 100 - 50 held - a's unused 20 = 30
    assert ledger.try_grant("a", 20) is GRANTED  # a's reserve was kept for it
    assert ledger.total_held == 100
    ledger.check_invariants()


def test_each_wait_reason_with_its_numbers_and_nothing_changed() -> None:
    ledger = BudgetLedger(100, {"a": ModelSettings(reserve=20), "b": ModelSettings(limit=50)})
    ledger.charge("b", 45)
    ledger.charge("c", 30)
    before = state_of(ledger)

    v = ledger.try_grant("b", 10)
    assert (v.outcome, v.reason, v.queued) == (Outcome.WAIT, Reason.OWN_LIMIT, False)
    assert (v.held, v.limit) == (45, 50)
    assert "holds 45 B of its 50 B limit" in v.message()

    v = ledger.try_grant("c", 10)
    assert v.reason is Reason.RESERVES_PROTECTED
    assert (v.budget, v.total_held, v.protected) == (100, 75, 20)
    assert "20 B of it is other models' unused reserve" in v.message()

    ledger2 = BudgetLedger(100)
    ledger2.charge("x", 95)
    v = ledger2.try_grant("y", 10)
    assert v.reason is Reason.BUDGET_FULL
    assert "has 5 B free (95 B held)" in v.message()
    assert state_of(ledger) == before


def test_never_over_limit_or_over_what_the_model_could_ever_get() -> None:
    ledger = BudgetLedger(100, {"a": ModelSettings(reserve=30), "b": ModelSettings(limit=40)})
    before = state_of(ledger)
    v = ledger.try_grant("b", 41)
    assert (v.outcome, v.reason, v.limit) == (Outcome.NEVER, Reason.OVER_LIMIT, 40)
    assert "over the model's limit (40 B)" in v.message()
    v = ledger.request("c", 71, "t", deadline=10.0, now=0.0)
    assert (v.outcome, v.reason, v.ceiling, v.queued) == (
        Outcome.NEVER,
        Reason.OVER_CEILING,
        70,
        False,
    )
    assert "can ever get (70 B" in v.message()
    assert ledger.request("c", 2**60, "t", deadline=10.0, now=0.0).outcome is Outcome.NEVER
    assert state_of(ledger) == before
    assert ledger.try_grant("c", 70) is GRANTED  # exactly the ceiling is fine


def test_a_request_of_zero_bytes_is_granted_even_behind_waiters() -> None:
    ledger = BudgetLedger(10)
    ledger.charge("a", 10)
    assert ledger.request("a", 5, "t1", 10.0, 0.0).queued
    assert ledger.request("a", 0, "t2", 10.0, 0.0) is GRANTED
    assert ledger.n_waiting == 1


# -- the queue ----------------------------------------------------------------------------


def test_request_waits_and_is_granted_charged_after_a_credit() -> None:
    ledger = BudgetLedger(100)
    ledger.charge("a", 90)
    v = ledger.request("b", 20, "t1", deadline=5.0, now=1.0)
    assert (v.outcome, v.reason, v.queued) == (Outcome.WAIT, Reason.BUDGET_FULL, True)
    assert ledger.is_waiting("t1") and ledger.n_waiting == 1
    view = ledger.snapshot(now=3.0).models["b"]
    assert (view.waiting, view.waiting_bytes, view.oldest_wait_s) == (1, 20, 2.0)
    assert ledger.grants() == []
    ledger.credit("a", 5)
    assert ledger.grants() == []  # 15 free, 20 needed
    ledger.credit("a", 5)
    assert ledger.grants() == ["t1"]
    assert (ledger.held("b"), ledger.n_waiting) == (20, 0)
    assert ledger.grants() == []
    ledger.check_invariants()


def test_fifo_within_a_model() -> None:
    ledger = BudgetLedger(100)
    ledger.charge("x", 100)
    ledger.request("a", 30, "big", 9.0, 0.0)
    v = ledger.request("a", 1, "small", 9.0, 0.0)
    assert (v.reason, v.queued) == (Reason.BEHIND_WAITERS, True)
    ledger.credit("x", 10)
    assert ledger.grants() == []  # small must not pass big of its own model
    ledger.credit("x", 21)
    assert ledger.grants() == ["big", "small"]


def test_models_below_their_reserve_go_first_in_arrival_order() -> None:
    ledger = BudgetLedger(100, {"r1": ModelSettings(reserve=20), "r2": ModelSettings(reserve=20)})
    ledger.charge("x", 60)  # the unreserved 60 bytes
    ledger.charge("r1", 20)
    ledger.charge("r2", 20)
    ledger.request("x", 10, "x-first", 9.0, 0.0)
    ledger.request("r2", 10, "r2", 9.0, 0.0)
    ledger.request("r1", 10, "r1", 9.0, 0.0)
    ledger.credit("r1", 10)  # r1 is below its reserve: its own 10 bytes are its again at once
    assert ledger.grants() == ["r1"]
    ledger.credit("r2", 10)
    assert ledger.grants() == ["r2"]
    ledger.credit("r1", 20)
    ledger.credit("r2", 20)
    # Both below reserve with free bytes: they took their reserves; x waits for unreserved bytes.
    assert ledger.request("r1", 20, "r1b", 9.0, 0.0) is GRANTED
    assert ledger.n_waiting == 1 and ledger.is_waiting("x-first")


def test_weighted_max_min_smallest_held_per_weight_first() -> None:
    ledger = BudgetLedger(100, {"heavy": ModelSettings(weight=3)})
    ledger.charge("heavy", 50)  # 50 / 3 = 16.7
    ledger.charge("light", 30)  # 30 / 1 = 30
    ledger.charge("x", 20)
    ledger.request("light", 10, "light", 9.0, 0.0)
    ledger.request("heavy", 10, "heavy", 9.0, 0.0)
    ledger.credit("x", 10)
    assert ledger.grants() == ["heavy"]  # arrived later, but holds less per weight
    ledger.credit("x", 10)
    assert ledger.grants() == ["light"]


def test_weighted_order_counts_the_head_as_weighted_fair_queuing_does() -> None:
    # 6 and 3 of 10 units at weights 2 and 1 tie on held/weight (3 each); the lighter model's
    # head came first, yet the unit goes to the heavier: 7/2 = 3.5 < 4/1 once granted.
    ledger = BudgetLedger(10, {"heavy": ModelSettings(weight=2)})
    ledger.charge("heavy", 6)
    ledger.charge("light", 3)
    ledger.charge("x", 1)
    ledger.request("light", 1, "light", 9.0, 0.0)
    ledger.request("heavy", 1, "heavy", 9.0, 1.0)
    ledger.credit("x", 1)
    assert ledger.grants() == ["heavy"]


def test_a_head_blocked_by_its_own_limit_does_not_block_others() -> None:
    ledger = BudgetLedger(100, {"capped": ModelSettings(limit=40)})
    ledger.charge("capped", 40)
    ledger.charge("x", 60)
    v = ledger.request("capped", 10, "capped", 9.0, 0.0)
    assert v.reason is Reason.OWN_LIMIT
    ledger.request("other", 10, "other", 9.0, 0.0)
    ledger.credit("x", 10)
    assert ledger.grants() == ["other"]
    ledger.credit("capped", 10)  # now capped holds 30: its 10 fit its limit, but the budget?
    assert ledger.grants() == ["capped"]


def test_backfill_up_to_entitlement_only_while_a_larger_head_is_blocked() -> None:
    ledger = BudgetLedger(100)
    ledger.charge("a", 90)  # a runs many sequences
    ledger.request("b", 30, "b-prefill", 9.0, 0.0)  # b's turn (it holds nothing)
    ledger.request("a", 5, "a-1", 9.0, 0.0)
    # Demand a 95, b 30: water-filling gives b 30 and a 70. a is above its share: when a
    # frees bytes they stay free for b's head instead of going back to a's next request.
    ledger.credit("a", 10)
    assert ledger.grants() == []  # 20 free: not enough for b, and a gets none of it
    assert ledger.held("a") == 80 and ledger.is_waiting("a-1")
    ledger.credit("a", 10)
    assert ledger.grants() == ["b-prefill"]
    ledger.credit("a", 10)
    assert ledger.grants() == ["a-1"]
    assert (ledger.held("a"), ledger.held("b")) == (65, 30)


def test_backfill_lets_a_model_below_its_share_go_past_a_blocked_head() -> None:
    ledger = BudgetLedger(100)
    ledger.charge("x", 88)
    ledger.charge("small", 10)  # 2 bytes free
    assert ledger.request("big", 60, "b1", 9.0, 0.0).reason is Reason.BUDGET_FULL
    # big (holding nothing) is first in line and blocked. Shares for the demand (x 90, small
    # 12, big 60): small 12, x 44, big 44. x is over its share: it may not take the 2 bytes.
    v = ledger.request("x", 2, "x1", 9.0, 0.0)
    assert (v.reason, v.queued) == (Reason.BEHIND_WAITERS, True)
    # small stays within its share: it goes past the blocked head.
    assert ledger.request("small", 2, "s1", 9.0, 0.0) is GRANTED
    assert ledger.snapshot().models["small"].entitlement == 12


def test_a_model_below_its_reserve_is_never_held_back_for_a_blocked_head() -> None:
    ledger = BudgetLedger(
        100,
        {
            "x": ModelSettings(weight=1000),
            "r1": ModelSettings(reserve=10),
            "r2": ModelSettings(reserve=10),
        },
    )
    ledger.charge("x", 78)
    assert ledger.request("r1", 50, "r1", 9.0, 0.0).queued  # first in line, blocked
    # r2's 12 bytes fit (22 free, r1's unused 10 protected) though its share is only 11:
    # below its reserve, it goes anyway.
    assert ledger.request("r2", 12, "r2", 9.0, 0.0) is GRANTED
    assert ledger.snapshot().models["r2"].entitlement == 11


def test_a_new_request_does_not_overtake_the_blocked_turn_holder() -> None:
    ledger = BudgetLedger(100)
    ledger.charge("a", 95)
    ledger.request("b", 30, "b", 9.0, 0.0)
    ledger.credit("a", 20)  # 25 free, b needs 30: a, over its share (70), gets none of it
    assert ledger.grants() == []
    v = ledger.try_grant("a", 5)
    assert (v.outcome, v.reason, v.queued) == (Outcome.WAIT, Reason.BEHIND_WAITERS, False)
    assert "queued behind" in v.message()
    v = ledger.request("a", 5, "a", 9.0, 0.0)
    assert (v.reason, v.queued) == (Reason.BEHIND_WAITERS, True)
    assert ledger.held("a") == 75
    # A third model holding nothing is below its share: it may use the free bytes.
    assert ledger.try_grant("c", 5) is GRANTED
    ledger.check_invariants()


def test_a_wait_0_try_after_a_free_leaves_no_waiting_request_with_its_bytes_free() -> None:
    # A free and a wait-0 allocation handled in one loop turn: the free unsettles the queue,
    # the try is decided before grants() runs. Placed first in the policy order and blocked,
    # it held b's head back (b over its share with c's demand counted); once it has gone,
    # nothing holds b back, and the next grants() must grant it.
    ledger = BudgetLedger(100, {"c": ModelSettings(weight=8)})
    ledger.charge("a", 90)
    assert ledger.request("b", 20, "b", 9.0, 0.0).queued  # 10 free: waits
    ledger.credit("a", 20)  # 30 free: b's 20 fit; grants() not called yet
    v = ledger.try_grant("c", 80)
    assert (v.outcome, v.queued) == (Outcome.WAIT, False)
    assert ledger.grants() == ["b"]
    ledger.check_invariants()


def test_a_request_refused_a_place_in_the_queue_after_a_free_leaves_no_one_waiting() -> None:
    # The same through _wait: c's request is settled with it in place, then refused
    # (the queue is full), and b must still be granted by the next grants().
    ledger = BudgetLedger(100, {"c": ModelSettings(weight=8)}, max_waiting=1)
    ledger.charge("a", 90)
    assert ledger.request("b", 20, "b", 9.0, 0.0).queued
    ledger.credit("a", 20)
    v = ledger.request("c", 80, "c", 9.0, 0.0)
    assert (v.outcome, v.reason, v.queued) == (Outcome.QUEUE_FULL, Reason.ALL_QUEUES_FULL, False)
    assert ledger.grants() == ["b"]
    ledger.check_invariants()


def test_try_grant_and_past_deadlines_never_queue() -> None:
    ledger = BudgetLedger(10)
    ledger.charge("a", 10)
    before = state_of(ledger)
    assert not ledger.try_grant("b", 1).queued
    v = ledger.request("b", 1, "t", deadline=5.0, now=5.0)
    assert (v.outcome, v.queued) == (Outcome.WAIT, False)
    ledger.request("c", 1, "c", deadline=6.0, now=5.0)
    assert not ledger.try_grant("b", 1).queued  # with a waiter: the slow path, same answer
    ledger.cancel("c")
    assert ledger.forget_model("c")  # a model that queued keeps its record until forgotten
    assert state_of(ledger)[0] == before[0]


def test_cancel_expire_and_next_deadline() -> None:
    ledger = BudgetLedger(10)
    ledger.charge("a", 10)
    ledger.request("b", 1, "late", deadline=9.0, now=0.0)
    ledger.request("b", 1, "early", deadline=3.0, now=0.0)
    ledger.request("c", 1, "mid", deadline=5.0, now=0.0)
    assert ledger.next_deadline() == 3.0
    assert ledger.expire(2.9) == []
    assert ledger.expire(5.0) == ["early", "mid"]
    assert ledger.next_deadline() == 9.0
    assert ledger.cancel("late") and not ledger.cancel("late") and not ledger.cancel("nope")
    assert ledger.next_deadline() is None and ledger.n_waiting == 0
    assert ledger.snapshot().models["b"].waiting_bytes == 0
    ledger.check_invariants()


def test_an_expired_blocked_head_lets_the_others_go() -> None:
    ledger = BudgetLedger(100)
    ledger.charge("a", 95)
    ledger.request("b", 30, "b", 3.0, 0.0)
    ledger.request("a", 5, "a", 9.0, 0.0)
    ledger.credit("a", 10)
    assert ledger.grants() == []
    assert ledger.expire(3.0) == ["b"]
    assert ledger.grants() == ["a"]


def test_duplicate_ticket_refused() -> None:
    ledger = BudgetLedger(10)
    ledger.charge("a", 10)
    ledger.request("b", 1, "t", 9.0, 0.0)
    before = state_of(ledger)
    with pytest.raises(ValueError, match="already waits"):
        ledger.request("c", 1, "t", 9.0, 0.0)
    with pytest.raises(ValueError, match="deadline and now must be numbers"):
        ledger.request("c", 1, "u", math.nan, 0.0)
    assert state_of(ledger) == before


def test_queue_bounds_per_model_and_in_all() -> None:
    ledger = BudgetLedger(10, max_waiting_per_model=2, max_waiting=3)
    ledger.charge("a", 10)
    assert ledger.request("b", 1, 1, 9.0, 0.0).queued
    assert ledger.request("b", 1, 2, 9.0, 0.0).queued
    before = state_of(ledger)
    v = ledger.request("b", 1, 3, 9.0, 0.0)
    assert (v.outcome, v.reason, v.queued) == (Outcome.QUEUE_FULL, Reason.MODEL_QUEUE_FULL, False)
    assert "retry later" in v.message()
    assert state_of(ledger) == before
    assert ledger.request("c", 1, 4, 9.0, 0.0).queued
    v = ledger.request("d", 1, 5, 9.0, 0.0)
    assert (v.outcome, v.reason) == (Outcome.QUEUE_FULL, Reason.ALL_QUEUES_FULL)
    assert ledger.n_waiting == 3
    ledger.check_invariants()


# -- live settings ------------------------------------------------------------------------


def test_lowering_the_budget_below_holdings_stops_grants_until_under() -> None:
    ledger = BudgetLedger(100)
    ledger.charge("a", 80)
    assert ledger.set_budget(50) == []
    snap = ledger.snapshot()
    assert (snap.free, snap.over_budget, ledger.held("a")) == (0, 30, 80)  # nothing taken back
    assert ledger.try_grant("b", 1).reason is Reason.BUDGET_FULL
    ledger.request("b", 10, "b", 9.0, 0.0)
    ledger.credit("a", 35)  # 45 held of 50: 5 free, 10 needed
    assert ledger.grants() == []
    ledger.credit("a", 5)
    assert ledger.grants() == ["b"]
    ledger.request("b", 10, "b2", 9.0, 0.0)
    ledger.set_budget(60)
    assert ledger.grants() == ["b2"]


def test_set_budget_refusals_and_impossible_waiters() -> None:
    ledger = BudgetLedger(100, {"a": ModelSettings(reserve=40)})
    before = state_of(ledger)
    with pytest.raises(ValueError, match="reserves sum to 40 B, over the budget 39 B"):
        ledger.set_budget(39)
    with pytest.raises(ValueError, match="budget must be an int"):
        ledger.set_budget(0)
    assert state_of(ledger) == before
    ledger.charge("b", 60)
    ledger.request("b", 50, "too-big-later", 9.0, 0.0)
    ledger.request("b", 5, "fine", 9.0, 0.0)
    refused = ledger.set_budget(80)  # b's ceiling is now 40
    assert [t for t, _ in refused] == ["too-big-later"]
    assert refused[0][1].outcome is Outcome.NEVER and refused[0][1].reason is Reason.OVER_CEILING
    assert ledger.is_waiting("fine") and ledger.n_waiting == 1
    ledger.check_invariants()


def test_set_model_live() -> None:
    ledger = BudgetLedger(100, {"a": ModelSettings(reserve=50)})
    ledger.charge("b", 50)
    before = state_of(ledger)
    with pytest.raises(ValueError, match="with model 'b''s new reserve sum to 101 B"):
        ledger.set_model("b", ModelSettings(reserve=51))
    with pytest.raises(ValueError, match="settings must be ModelSettings"):
        ledger.set_model("b", None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="model name must be a str"):
        ledger.set_model(7, ModelSettings())  # type: ignore[arg-type]
    assert state_of(ledger) == before
    # A limit below what b holds takes nothing back; b gets nothing more until under it.
    ledger.request("b", 5, "b1", 9.0, 0.0)
    ledger.request("b", 35, "b2", 9.0, 0.0)
    refused = ledger.set_model("b", ModelSettings(limit=30))
    assert [(t, v.reason) for t, v in refused] == [("b2", Reason.OVER_LIMIT)]
    assert ledger.held("b") == 50 and ledger.settings_of("b") == ModelSettings(limit=30)
    ledger.credit("b", 20)
    assert ledger.grants() == []  # 30 + 5 is over 30
    ledger.credit("b", 5)
    assert ledger.grants() == ["b1"]
    assert ledger.held("b") == 30
    # Lowering a's reserve frees bytes for the others; raising it protects them again.
    ledger.set_model("a", ModelSettings(reserve=10))
    assert ledger.try_grant("c", 50) is GRANTED
    ledger.check_invariants()


def test_forget_model() -> None:
    ledger = BudgetLedger(100, {"kept": ModelSettings(reserve=1)})
    ledger.charge("gone", 5)
    assert not ledger.forget_model("gone")  # still holds bytes
    ledger.credit("gone", 5)
    assert ledger.forget_model("gone")
    assert "gone" not in ledger.snapshot().models
    assert not ledger.forget_model("kept") and not ledger.forget_model("never-seen")
    ledger.charge("w", 100)
    ledger.request("waits", 1, "t", 9.0, 0.0)
    assert not ledger.forget_model("waits")
    ledger.check_invariants()


# -- will it fit? --------------------------------------------------------------------------


def test_bytes_for_context() -> None:
    per_block = {"k": 1000, "v": 1000, "kv": 2000}
    assert bytes_for_context(16, 16, per_block, streams=("k", "v")) == 2000
    assert bytes_for_context(17, 16, per_block, streams=("k", "v")) == 4000
    assert bytes_for_context(1, 16, {"kv": 500}) == 500
    for bad in ({"context_tokens": 0}, {"block_size": 0}, {"context_tokens": 1.5}):
        args: dict[str, Any] = {"context_tokens": 10, "block_size": 16, **bad}
        with pytest.raises(ValueError, match="must be a positive int"):
            bytes_for_context(bytes_per_block=per_block, **args)
    with pytest.raises(ValueError, match="no bytes per block declared for stream 'v'"):
        bytes_for_context(10, 16, {"k": 1}, streams=("k", "v"))
    with pytest.raises(ValueError, match="must be an int >= 0"):
        bytes_for_context(10, 16, {"k": -1})
    with pytest.raises(ValueError, match="no streams"):
        bytes_for_context(10, 16, {})


def test_fit_verdicts_in_order() -> None:
    ledger = BudgetLedger(
        100, {"a": ModelSettings(reserve=30, limit=80), "b": ModelSettings(reserve=20)}
    )
    ledger.charge("a", 30)
    ledger.charge("b", 60)  # b borrows 40
    # a: 10 free now (100 - 90, b's reserve is used); 50 on top once b is back within its reserve.
    now = ledger.fit("a", 5, 2)
    assert (now.verdict, now.need, now.available_now, now.max_concurrency_now) == ("now", 10, 10, 2)
    reserve = ledger.fit("a", 15, 2)
    assert (reserve.verdict, reserve.reserve) == ("within_reserve", 30)
    after = ledger.fit("a", 40, 1)
    assert (after.verdict, after.available_after_return, after.most_ever) == (
        "after_others_return",
        50,
        80,
    )
    never = ledger.fit("a", 27, 3)
    assert (never.verdict, never.need, never.limit) == ("never", 81, 80)
    assert never.max_concurrency_ever == 2
    assert ledger.fit("c", 81, 1).verdict == "never"  # 100 - the reserves (50) is its most
    assert "c" not in ledger.snapshot().models  # asking changes nothing
    with pytest.raises(ValueError, match="concurrency must be a positive int"):
        ledger.fit("a", 1, 0)


def test_fit_counts_the_models_own_prompt_cache_as_available_now() -> None:
    ledger = BudgetLedger(100, {"a": ModelSettings(limit=60), "b": ModelSettings(reserve=20)})
    ledger.charge("a", 50)  # 40 of it a's idle prompt cache
    ledger.charge("b", 40)
    plain = ledger.fit("a", 10, 1)
    assert (plain.available_now, plain.own_cache_now) == (10, 0)
    cached = ledger.fit("a", 10, 5, own_cache=40)
    # Its cache given back, a holds 10: 50 more within its limit of 60 (the budget has 50).
    assert (cached.verdict, cached.available_now, cached.own_cache_now) == ("now", 50, 40)
    assert cached.max_concurrency_now == 5 and cached.held == 50
    assert cached.available_after_return == 50  # b is within its reserve: nothing more to return
    # A stale report of more than it holds counts only what it holds.
    assert ledger.fit("a", 10, 1, own_cache=500).available_now == 60
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="own_cache"):
            ledger.fit("a", 10, 1, own_cache=bad)  # type: ignore[arg-type]


def test_the_fit_example_of_docs_budget_md() -> None:
    ledger = BudgetLedger(
        16 * GiB,
        {"llama": ModelSettings(4 * GiB, 10 * GiB), "qwen": ModelSettings(2 * GiB)},
    )
    ledger.charge("llama", 3 * GiB)
    ledger.charge("qwen", 9 * GiB)
    per_block = {"k": GiB // 1024, "v": GiB // 1024}
    sequence = bytes_for_context(8192, 16, per_block)
    assert sequence == GiB
    two = ledger.fit("llama", sequence, 2)
    assert (two.verdict, two.max_concurrency_now) == ("now", 4)
    six = ledger.fit("llama", sequence, 6)
    assert (six.verdict, six.available_after_return) == ("after_others_return", 7 * GiB)
    assert ledger.fit("llama", sequence, 11).verdict == "never"


# -- snapshot and water-filling -----------------------------------------------------------


def test_snapshot_borrowed_and_entitlement() -> None:
    ledger = BudgetLedger(
        100, {"a": ModelSettings(reserve=20, weight=1), "b": ModelSettings(weight=3)}
    )
    ledger.charge("a", 60)
    ledger.charge("b", 30)
    ledger.request("b", 40, "t", 9.0, 0.0)
    snap = ledger.snapshot()
    a, b = snap.models["a"], snap.models["b"]
    assert (snap.budget, snap.total_held, snap.free, snap.reserved, snap.protected) == (
        100,
        90,
        10,
        20,
        0,
    )
    assert (a.borrowed, b.borrowed) == (40, 30)
    # Demand a 60, b 70; a's floor is 20; the rest by weight 1:3 -> a 25, b 75 capped at 70.
    assert (a.entitlement, b.entitlement) == (30, 70)


def test_idle_reserves_are_not_shared_out() -> None:
    ledger = BudgetLedger(100, {"idle": ModelSettings(reserve=40), "half": ModelSettings(20)})
    ledger.charge("a", 40)
    ledger.charge("half", 10)  # free: 50, all of it idle reserve
    assert ledger.request("a", 10, "a", 9.0, 0.0).queued
    assert ledger.request("b", 40, "b", 9.0, 0.0).queued
    models = ledger.snapshot().models
    # 40 idle in "idle", 10 idle in "half": 50 bytes to share; half keeps its 10, a and b 20 each.
    assert [models[m].entitlement for m in ("idle", "half", "a", "b")] == [0, 10, 20, 20]


def test_water_fill() -> None:
    assert water_fill(100, [(0, 100, 1), (0, 100, 1)]) == [50, 50]
    assert water_fill(100, [(0, 100, 1), (0, 100, 3)]) == [25, 75]
    assert water_fill(100, [(0, 10, 1), (0, 100, 1)]) == [10, 90]
    assert water_fill(100, [(40, 100, 1), (0, 100, 1)]) == [50, 50]
    assert water_fill(100, [(70, 100, 1), (0, 100, 1)]) == [70, 30]
    assert water_fill(100, [(0, 20, 1), (0, 30, 1)]) == [20, 30]  # all demand fits
    assert water_fill(100, [(60, 60, 1), (40, 80, 1)]) == [60, 40]
    assert water_fill(10, []) == []


@given(
    st.lists(
        st.tuples(st.integers(0, 50), st.integers(0, 100), st.sampled_from([0.5, 1, 2, 3])),
        max_size=6,
    ),
    st.integers(1, 400),
)
def test_water_fill_properties(raw: list[tuple[int, int, float]], capacity: int) -> None:
    shares = [(min(f, c), c, w) for f, c, w in raw]
    if sum(f for f, _, _ in shares) > capacity:
        return
    got = water_fill(capacity, shares)
    for (floor, cap, _), x in zip(shares, got, strict=True):
        assert floor - 1e-6 <= x <= cap + 1e-6
    total = sum(got)
    assert total <= capacity + 1e-6
    if total < capacity - 1e-6:
        assert all(abs(x - c) < 1e-6 for (_, c, _), x in zip(shares, got, strict=True))
    # Max-min: a party above its floor and below its cap has the highest level among those.
    levels = [x / w for (f, c, w), x in zip(shares, got, strict=True) if f + 1e-6 < x < c - 1e-6]
    if levels:
        top = max(levels)
        for (f, c, w), x in zip(shares, got, strict=True):
            if x < c - 1e-6:
                assert x / w >= top - 1e-6 or x <= f + 1e-6


# -- weights beside KV ---------------------------------------------------------------------


def test_weights_take_the_room_of_kv_and_keep_reserves_and_limits_for_kv() -> None:
    ledger = BudgetLedger(100, {"a": ModelSettings(reserve=20, limit=30)})
    ledger.set_weights("a", "worker-1", 40)
    ledger.set_weights("b", "worker-2", 30)
    assert (ledger.total_weights, ledger.weights("a"), ledger.weights("b")) == (70, 40, 30)
    # KV room: 100 - 70 = 30; a's limit (30) and reserve (20) are KV only.
    assert ledger.try_grant("b", 11).outcome is Outcome.WAIT  # a's unused reserve is a's
    assert ledger.try_grant("a", 30).outcome is Outcome.GRANT
    snap = ledger.snapshot()
    assert (snap.total_held, snap.total_weights, snap.free) == (30, 70, 0)
    assert snap.models["a"].weights == 40 and snap.models["a"].held == 30
    # A measurement may raise weights past the budget: nothing more is granted, and reclaim
    # counts the excess.
    ledger.set_weights("b", "worker-2", 40)
    assert ledger.snapshot().over_budget == 10
    assert ledger.reclaim_need().short == 10
    assert ledger.try_grant("b", 1).outcome is Outcome.WAIT
    ledger.credit("a", 30)
    ledger.set_weights("b", "worker-2", 0)  # its session ended
    assert ledger.total_weights == 40 and ledger.try_grant("a", 30).outcome is Outcome.GRANT
    assert ledger.forget_model("b")  # holds nothing, weights gone
    ledger.check_invariants()


def test_a_load_reservation_is_granted_short_or_never_with_the_numbers() -> None:
    ledger = BudgetLedger(10 * 2**20, {"other": ModelSettings(reserve=2 * 2**20)})
    MiB = 2**20
    granted = ledger.reserve_load("m", "load-1", 4 * MiB, 2 * MiB)
    assert granted.outcome is LoadOutcome.GRANT and ledger.weights("m") == 4 * MiB
    # Free for n: 10 - 4 (m's weights) - 2 (other's unused reserve) = 4 MiB.
    short = ledger.reserve_load("n", "load-2", 3 * MiB, 2 * MiB)
    assert short.outcome is LoadOutcome.SHORT
    assert (short.free, short.short) == (4 * MiB, MiB)
    assert short.message() == (
        "loading n needs 3 MiB of weights and 2 MiB of KV; 4 MiB free now, 1 MiB short"
    )
    assert ledger.weights("n") == 0 and "n" not in ledger.snapshot().models
    never = ledger.reserve_load("big", "load-3", 7 * MiB, 2 * MiB)
    assert never.outcome is LoadOutcome.NEVER
    assert never.message() == (
        "loading big needs 7 MiB of weights and 2 MiB of KV; the budget is 10 MiB and other "
        "models reserve 2 MiB: it can never fit"
    )
    with pytest.raises(ValueError, match="already holds weights"):
        ledger.reserve_load("m", "load-1", MiB, 0)
    ledger.check_invariants()


# -- weighted shares converge -------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    weights=st.lists(st.sampled_from([1, 2, 3, 5]), min_size=2, max_size=3),
    reserves=st.lists(st.integers(0, 60), min_size=3, max_size=3),
    limits=st.lists(st.none() | st.integers(20, 200), min_size=3, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_weighted_shares_converge_under_continuous_demand(
    weights: list[int], reserves: list[int], limits: list[int | None], seed: int
) -> None:
    """Unit requests, every model always wanting more, bytes freed one at a time from a random
    holder: holdings settle at the water-filling shares (reserves and limits respected)."""
    budget = 200
    names = [f"m{i}" for i in range(len(weights))]
    configs = {}
    for i, name in enumerate(names):
        reserve = reserves[i] if sum(reserves[: i + 1]) <= budget else 0
        cap = limits[i]
        limit = None if cap is None else max(cap, reserve)
        configs[name] = ModelSettings(reserve=reserve, limit=limit, weight=weights[i])
    ledger = BudgetLedger(budget, configs)
    rng = random.Random(seed)
    ledger.charge("filler", budget)  # start full: every byte is handed out by the policy
    tickets = iter(range(10**9))
    for _ in range(6 * budget):
        for name in names:
            while ledger.snapshot().models[name].waiting < 3:
                ledger.request(name, 1, next(tickets), math.inf, 0.0)
        holders = [n for n in [*names, "filler"] if ledger.held(n)]
        victim = "filler" if ledger.held("filler") else rng.choice(holders)
        ledger.credit(victim, 1)
        ledger.grants()
    expected = water_fill(
        budget,
        [
            (s.reserve, budget if s.limit is None else min(s.limit, budget), s.weight)
            for s in configs.values()
        ],
    )
    for name, want in zip(names, expected, strict=True):
        assert abs(ledger.held(name) - want) <= 2, (name, ledger.held(name), want, configs)
    ledger.check_invariants()


# -- the model-based test -----------------------------------------------------------------

MODELS = ["a", "b", "c"]


class LedgerMachine(RuleBasedStateMachine):
    """Random requests, credits, charges, cancels, deadlines, setting changes and weights
    (loads reserved, measured, released), with the integrator's discipline: grants() after
    every change. Checked after every step: the ledger's own recount; KV plus weights within
    the budget and KV within limits (unless an operator lowered them below what was held, or a
    measurement raised weights, and then nothing more was granted); FIFO within a model; weights
    per holder as charged, never negative; and no model below its reserve left waiting with a
    head that fits."""

    @initialize(
        budget=st.integers(1, 300),
        raw=st.lists(
            st.tuples(
                st.integers(0, 100), st.none() | st.integers(0, 300), st.sampled_from([0.5, 1, 3])
            ),
            min_size=3,
            max_size=3,
        ),
    )
    def build(self, budget: int, raw: list[tuple[int, int | None, float]]) -> None:
        configs = {}
        reserved = 0
        for name, (reserve, limit, weight) in zip(MODELS, raw, strict=True):
            reserve = reserve if reserved + reserve <= budget else 0
            reserved += reserve
            limit = None if limit is None else max(limit, reserve)
            configs[name] = ModelSettings(reserve, limit, weight)
        self.ledger = BudgetLedger(
            budget,
            configs,
            max_waiting_per_model=6,
            max_waiting=12,
            lend_reserves=self.lend_reserves,
        )
        self.now = 0.0
        self.next_ticket = 0
        self.queued: dict[str, deque[Hashable]] = defaultdict(deque)  # per model, arrival order
        self.over_limit_ok: set[str] = set()  # operator lowered a limit, or a forced charge
        self.over_budget_ok = False
        self.weights: dict[tuple[str, Hashable], int] = {}  # (model, holder) -> bytes charged
        self.next_load = 0

    # -- helpers --

    def _settle(self) -> None:
        self._take_grants(self.ledger.grants())

    def _take_grants(self, granted: list[Hashable]) -> None:
        ledger = self.ledger
        for ticket in granted:
            model = self.model_of.pop(ticket)
            del self.bytes_of[ticket]
            assert self.queued[model][0] == ticket, f"FIFO broken in {model}: {ticket}"
            self.queued[model].popleft()
            assert ledger.held(model) <= ledger.snapshot().models[model].effective_limit
        if granted:
            assert ledger.total_held + ledger.total_weights <= ledger.budget

    def _forget(self, ticket: Hashable) -> None:
        model = self.model_of.pop(ticket)
        del self.bytes_of[ticket]
        self.queued[model].remove(ticket)

    def _refresh_over_flags(self) -> None:
        snap = self.ledger.snapshot()
        for name, view in snap.models.items():
            if view.held <= view.effective_limit:
                self.over_limit_ok.discard(name)
        if snap.over_budget == 0:
            self.over_budget_ok = False

    model_of: dict[Hashable, str]
    bytes_of: dict[Hashable, int]
    lend_reserves = False

    def __init__(self) -> None:
        super().__init__()
        self.model_of = {}
        self.bytes_of = {}

    # -- rules --

    @rule(model=st.sampled_from(MODELS), n=st.integers(0, 120), wait=st.integers(0, 5))
    def request(self, model: str, n: int, wait: int) -> None:
        self._request(model, n, wait)
        self._settle()

    def _request(self, model: str, n: int, wait: int) -> None:
        ledger = self.ledger
        ticket = self.next_ticket
        self.next_ticket += 1
        held_before = ledger.held(model)
        v = ledger.request(model, n, ticket, self.now + wait, self.now)
        if v.outcome is Outcome.GRANT:
            assert ledger.held(model) == held_before + n
            if n:
                assert ledger.total_held + ledger.total_weights <= ledger.budget
                assert ledger.held(model) <= ledger.snapshot().models[model].effective_limit
                assert not self.queued[model], "overtook its own model's waiters"
        elif v.queued:
            assert v.outcome is Outcome.WAIT and ledger.is_waiting(ticket)
            self.model_of[ticket] = model
            self.bytes_of[ticket] = n
            self.queued[model].append(ticket)
        else:
            assert not ledger.is_waiting(ticket)
            if v.outcome is Outcome.NEVER:
                assert n > v.ceiling

    @rule(model=st.sampled_from(MODELS), n=st.integers(0, 120))
    def try_grant(self, model: str, n: int) -> None:
        self._try_grant(model, n)
        self._settle()

    def _try_grant(self, model: str, n: int) -> None:
        ledger = self.ledger
        held_before = ledger.held(model)
        v = ledger.try_grant(model, n)
        assert not v.queued
        if v.outcome is Outcome.GRANT:
            assert ledger.held(model) == held_before + n
            if n:
                assert ledger.total_held + ledger.total_weights <= ledger.budget
                assert ledger.held(model) <= ledger.snapshot().models[model].effective_limit
                assert not self.queued[model], "overtook its own model's waiters"
        else:
            assert ledger.held(model) == held_before

    @precondition(lambda self: self.ledger.total_held > 0)
    @rule(data=st.data())
    def credit(self, data: st.DataObject) -> None:
        self._credit(data)
        self._settle()

    def _credit(self, data: st.DataObject, for_a_head: bool = False) -> None:
        ledger = self.ledger
        holders = [m for m, v in ledger.snapshot().models.items() if v.held]
        model = data.draw(st.sampled_from(holders))
        held = ledger.held(model)
        amounts = st.integers(1, held)
        if for_a_head:  # often just what a waiting head lacks
            free = ledger.budget - ledger.total_held - ledger.total_weights
            lacks = [self.bytes_of[q[0]] - free for q in self.queued.values() if q]
            amounts |= st.sampled_from([min(held, max(1, n)) for n in lacks])
        n = data.draw(amounts)
        ledger.credit(model, n)
        self._refresh_over_flags()

    @precondition(lambda self: self.ledger.total_held > 0)
    @rule(data=st.data(), wait=st.none() | st.integers(0, 5))
    def free_and_allocate_in_one_turn(self, data: st.DataObject, wait: int | None) -> None:
        """The daemon's loop turn: a free, then an allocation (a wait-0 try, or a request that
        may be refused a place) handled before grants() runs. The allocation is drawn mostly
        for a model with nothing waiting, often the one first in the policy order, and for a
        little more than is free: one placed first in the policy order, blocked, that then
        leaves the queue. With nothing waiting, a long wait is queued first (when the
        bytes are short): the request the free is for."""
        if not self.model_of:
            model = data.draw(st.sampled_from(MODELS))
            free = max(0, self.ledger.budget - self.ledger.total_held - self.ledger.total_weights)
            self._request(model, data.draw(st.integers(free + 1, free + 60)), 20)
            if not self.model_of:
                return
        self._credit(data, for_a_head=True)
        snap = self.ledger.snapshot()
        idle = [m for m in MODELS if not self.queued[m]] or MODELS

        def order(m: str) -> tuple[bool, float]:
            view = snap.models.get(m)
            return (False, 0.0) if view is None else (view.held >= view.reserve, -view.weight)

        model = data.draw(st.sampled_from(idle) | st.just(min(idle, key=order)))
        free = max(0, snap.budget - snap.total_held - snap.total_weights)
        n = data.draw(st.integers(0, 120) | st.integers(1, 60).map(lambda e: free + e))
        if wait is None:
            self._try_grant(model, n)
        else:
            self._request(model, n, wait)
        self._settle()

    @precondition(lambda self: self.model_of)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        ticket = data.draw(st.sampled_from(sorted(self.model_of, key=repr)))
        assert self.ledger.cancel(ticket)
        self._forget(ticket)
        self._settle()

    @rule(step=st.integers(0, 4))
    def tick(self, step: int) -> None:
        self.now += step
        for ticket in self.ledger.expire(self.now):
            self._forget(ticket)
        self._settle()

    @rule(budget=st.integers(1, 300))
    def set_budget(self, budget: int) -> None:
        ledger = self.ledger
        reserved = ledger.snapshot().reserved
        if budget < reserved:
            before = state_of(ledger)
            with pytest.raises(ValueError):
                ledger.set_budget(budget)
            assert state_of(ledger) == before
            return
        for ticket, verdict in ledger.set_budget(budget):
            assert verdict.outcome is Outcome.NEVER
            self._forget(ticket)
        for name, view in ledger.snapshot().models.items():
            if view.held > view.effective_limit:
                self.over_limit_ok.add(name)
        if ledger.total_held + ledger.total_weights > budget:
            self.over_budget_ok = True
        self._settle()

    @rule(
        model=st.sampled_from(MODELS),
        reserve=st.integers(0, 120),
        limit=st.none() | st.integers(0, 300),
        weight=st.sampled_from([0.5, 1, 2, 5]),
    )
    def set_model(self, model: str, reserve: int, limit: int | None, weight: float) -> None:
        ledger = self.ledger
        if limit is not None and reserve > limit:
            with pytest.raises(ValueError):
                ModelSettings(reserve, limit, weight)
            return
        settings_ = ModelSettings(reserve, limit, weight)
        snap = ledger.snapshot()
        old = snap.models[model].reserve if model in snap.models else 0
        if snap.reserved - old + reserve > ledger.budget:
            before = state_of(ledger)
            with pytest.raises(ValueError):
                ledger.set_model(model, settings_)
            assert state_of(ledger) == before
            return
        for ticket, verdict in ledger.set_model(model, settings_):
            assert verdict.outcome is Outcome.NEVER
            self._forget(ticket)
        view = ledger.snapshot().models[model]
        if view.held > view.effective_limit:
            self.over_limit_ok.add(model)
        self._settle()

    @rule(model=st.sampled_from(MODELS), weights=st.integers(0, 150), kv_min=st.integers(0, 100))
    def reserve_load(self, model: str, weights: int, kv_min: int) -> None:
        ledger = self.ledger
        key = ("load", self.next_load)
        self.next_load += 1
        before = state_of(ledger)
        snap = before[0]
        view = snap.models.get(model)
        reserve = 0 if view is None else view.reserve
        limit = ledger.budget if view is None else view.effective_limit
        v = ledger.reserve_load(model, key, weights, kv_min)
        assert (v.weights, v.kv_min) == (weights, kv_min)
        if v.outcome is LoadOutcome.GRANT:
            if weights:  # 0 bytes charge nothing (no holder key is kept)
                self.weights[(model, key)] = weights
            assert ledger.weights_of(model, key) == weights
            assert ledger.total_held + ledger.total_weights + kv_min <= ledger.budget
            assert v.short == 0
        else:
            assert state_of(ledger) == before  # nothing charged
            never = kv_min > limit or weights + max(kv_min, reserve) > (
                ledger.budget - (snap.reserved - reserve)
            )
            assert (v.outcome is LoadOutcome.NEVER) == never, v
            if not never:
                assert v.short == weights + kv_min - v.free > 0
        self._settle()

    @precondition(lambda self: self.weights)
    @rule(data=st.data(), n=st.integers(0, 150))
    def measure_weights(self, data: st.DataObject, n: int) -> None:
        """A heartbeat's measurement (or the holder's end, with 0): unconditional."""
        model, key = data.draw(st.sampled_from(sorted(self.weights, key=repr)))
        self.ledger.set_weights(model, key, n)
        if n:
            self.weights[(model, key)] = n
        else:
            del self.weights[(model, key)]
        if self.ledger.total_held + self.ledger.total_weights > self.ledger.budget:
            self.over_budget_ok = True
        self._refresh_over_flags()
        self._settle()

    # -- invariants --

    @invariant()
    def weights_as_charged(self) -> None:
        if not hasattr(self, "ledger"):
            return
        ledger = self.ledger
        assert ledger.total_weights == sum(self.weights.values())
        for (model, key), n in self.weights.items():
            assert ledger.weights_of(model, key) == n > 0
        for model in MODELS:
            charged = sum(n for (m, _), n in self.weights.items() if m == model)
            assert ledger.weights(model) == charged >= 0

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "ledger"):
            return
        ledger = self.ledger
        ledger.check_invariants()
        snap = ledger.snapshot()
        assert snap.total_held + snap.total_weights <= snap.budget or self.over_budget_ok
        for name, view in snap.models.items():
            assert view.held <= view.effective_limit or name in self.over_limit_ok, name
            assert view.waiting == len(self.queued[name])
        assert set(self.model_of) == {t for q in self.queued.values() for t in q}

    @invariant()
    def settled(self) -> None:
        """After grants(): a waiting head that fits is held back only by the backfill guard,
        never when its model is below its reserve."""
        if not hasattr(self, "ledger"):
            return
        ledger = self.ledger
        snap = ledger.snapshot()
        free = snap.budget - snap.total_held - snap.total_weights
        heads_blocked_by_bytes = False
        fitting = []
        for name, queue in self.queued.items():
            if not queue:
                continue
            view = snap.models[name]
            n = self.bytes_of[queue[0]]
            unused_own = max(0, view.reserve - view.held)
            if view.held + n > view.effective_limit:
                continue
            protected = 0 if ledger.lend_reserves else snap.protected - unused_own
            if n <= free - protected:
                fitting.append((name, view, n))
            else:
                heads_blocked_by_bytes = True
        for name, view, n in fitting:
            assert view.held >= view.reserve, f"{name} below its reserve left waiting for {n}"
            assert heads_blocked_by_bytes, f"{name}'s head of {n} fits and nothing blocks it"
            assert view.held + n > view.entitlement, f"{name} within its share left waiting"

    @invariant()
    def nobody_waits_with_its_bytes_free_and_nothing_ahead(self) -> None:
        """After grants(): a waiting head whose bytes are free (the three rules hold) waits only
        behind another model's head that comes before it in the policy order and does not fit
        (the backfill guard); nothing else may keep it waiting."""
        if not hasattr(self, "ledger"):
            return
        ledger = self.ledger
        snap = ledger.snapshot()
        free = snap.budget - snap.total_held - snap.total_weights

        def fits(view: Any, n: int) -> bool:
            unused_own = max(0, view.reserve - view.held)
            protected = 0 if ledger.lend_reserves else snap.protected - unused_own
            return view.held + n <= view.effective_limit and n <= free - protected

        def policy_key(view: Any, ticket: int, n: int) -> tuple[int, float, int]:
            if view.held < view.reserve:
                return (0, 0.0, ticket)
            return (1, (view.held + n) / view.weight, ticket)

        heads = []
        for name, queue in self.queued.items():
            if queue:
                view = snap.models[name]
                n = self.bytes_of[queue[0]]
                if view.held + n <= view.effective_limit:  # else it waits for its own bytes
                    heads.append((policy_key(view, queue[0], n), name, fits(view, n)))
        heads.sort()
        blocked_ahead = None
        for _, name, fit in heads:
            if not fit:
                blocked_ahead = blocked_ahead or name
                continue
            assert blocked_ahead is not None, (
                f"{name}'s head waits with its bytes free and nothing ahead of it"
            )


# 200 examples of 50 steps (was 300): 10,000 ledger steps a run, in about 3 s; every run draws
# new examples, so the suite's runs keep exploring.
LedgerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
test_ledger_machine = LedgerMachine.TestCase


class LendingLedgerMachine(LedgerMachine):
    """The same machine with reserves lent, and a reclaim rule: whenever the ledger says bytes
    must come back, the models it names give them back (largest excess first) and the waiting
    demand it was short for is then covered. Checked: it never asks for more than the waiting
    demand owed plus what is held over the budget, never names a model at or below its reserve
    or its entitlement, and lent bytes are the unused reserves the free bytes do not cover."""

    lend_reserves = True

    @precondition(lambda self: hasattr(self, "ledger"))
    @rule()
    def reclaim(self) -> None:
        ledger = self.ledger
        need = ledger.reclaim_need()
        snap = ledger.snapshot()
        assert need.short <= sum(need.wanted.values()) + snap.over_budget
        owed = 0
        for name, n in need.excess:
            view = snap.models[name]
            assert n > 0 and view.held - n >= view.entitlement - 1
            assert view.held > view.reserve, f"{name} asked back at or below its reserve"
            assert name not in need.wanted
            take = min(n, need.short - owed)
            if take <= 0:
                break
            ledger.credit(name, take)
            owed += take
        self._refresh_over_flags()
        # KV given back covers any shortage while the weights and the reserves fit the budget
        # together (past that, a model is never asked below its reserve: an idle model's
        # weights are the front door's to unload).
        if need.short and ledger.total_weights + snap.reserved <= ledger.budget:
            assert owed == need.short, "the models above their share could not cover it"
            # The bytes owed now exist: free bytes cover the demand the ledger was short for.
            assert ledger.total_held + ledger.total_weights + sum(need.wanted.values()) <= (
                ledger.budget
            )
        self._settle()

    @invariant()
    def lent_accounted(self) -> None:
        if not hasattr(self, "ledger"):
            return
        snap = self.ledger.snapshot()
        assert snap.lend_reserves
        free = snap.budget - snap.total_held - snap.total_weights
        assert snap.lent == min(snap.protected, max(0, snap.protected - free))
        assert sum(v.lent for v in snap.models.values()) <= snap.lent
        for view in snap.models.values():
            assert view.lent <= max(0, view.reserve - view.held)


LendingLedgerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None
)
test_lending_ledger_machine = LendingLedgerMachine.TestCase


def test_lending_grants_unused_reserves_and_reclaim_names_the_borrower() -> None:
    ledger = BudgetLedger(100, {"a": ModelSettings(reserve=60)}, lend_reserves=True)
    assert ledger.try_grant("b", 90).outcome is Outcome.GRANT  # 50 of a's reserve on loan
    snap = ledger.snapshot()
    assert (snap.lent, snap.models["a"].lent) == (50, 50)
    assert ledger.reclaim_need().short == 0  # a wants nothing: nothing is taken back
    assert ledger.request("a", 30, "t1", 10.0, 0.0).queued
    need = ledger.reclaim_need()
    assert (need.short, need.wanted, need.excess) == (20, {"a": 30}, [("b", 20)])
    ledger.credit("b", 20)  # b's worker gave back what was asked
    assert ledger.grants() == ["t1"]
    assert ledger.reclaim_need().short == 0


def test_without_lending_reserves_stay_idle_and_nothing_is_reclaimed_from_a_reserve() -> None:
    ledger = BudgetLedger(100, {"a": ModelSettings(reserve=60)})
    assert ledger.try_grant("b", 90).outcome is Outcome.NEVER  # over 100 - a's reserve
    assert ledger.try_grant("b", 40).outcome is Outcome.GRANT
    assert ledger.try_grant("b", 1).reason is Reason.RESERVES_PROTECTED
    assert ledger.request("a", 40, "t1", 10.0, 0.0).outcome is Outcome.GRANT
    assert ledger.snapshot().lent == 0


def test_reclaim_asks_the_largest_weighted_excess_first_and_only_what_is_short() -> None:
    models = {"a": ModelSettings(reserve=40), "b": ModelSettings(weight=1), "c": ModelSettings()}
    ledger = BudgetLedger(100, models, lend_reserves=True)
    assert ledger.try_grant("b", 70).outcome is Outcome.GRANT
    assert ledger.try_grant("c", 25).outcome is Outcome.GRANT
    assert ledger.request("a", 10, "t1", 10.0, 0.0).queued  # 5 free, 10 wanted
    need = ledger.reclaim_need()
    assert need.short == 5 and need.wanted == {"a": 10}
    assert [name for name, _ in need.excess] == ["b", "c"][: len(need.excess)]
    assert need.excess[0][0] == "b"


def test_a_budget_lowered_below_holdings_needs_the_excess_back() -> None:
    ledger = BudgetLedger(100, {"a": ModelSettings(reserve=20)}, lend_reserves=True)
    assert ledger.try_grant("b", 80).outcome is Outcome.GRANT
    ledger.set_budget(50)
    need = ledger.reclaim_need()
    assert need.short == 30 and need.excess[0][0] == "b"


# -- reclaim planning with many waiting models ----------------------------------------------


def reference_reclaim_need(
    ledger: BudgetLedger, queued: dict[str, list[int]], up_to_share: bool, margin: float
) -> tuple[int, dict[str, int], list[tuple[str, int]]]:
    """What reclaim_need answers, computed the straightforward way from the snapshot: one
    water-filling for the entitlements, and one more per waiting model for its full share."""
    snap = ledger.snapshot()
    views = snap.models

    def shares(wanting_all: str | None = None) -> dict[str, float]:
        names, parts, idle = [], [], 0
        for name, v in views.items():
            demand = v.effective_limit if name == wanting_all else v.held + v.waiting_bytes
            idle += max(0, v.reserve - demand)
            if demand:
                names.append(name)
                parts.append((min(demand, v.reserve), min(demand, v.effective_limit), v.weight))
        capacity = snap.budget if snap.lend_reserves else snap.budget - idle
        return dict(zip(names, water_fill(capacity, parts), strict=True))

    over = max(0, snap.total_held - snap.budget)
    if not any(queued.values()) and not over:
        return 0, {}, []
    entitlement = shares()
    wanted: dict[str, int] = {}
    unused = 0
    for name, sizes in queued.items():
        if not sizes:
            continue
        v = views[name]
        share = entitlement.get(name, 0.0)
        owed = up_to_share and v.held < share
        if owed and margin:
            owed = v.held < (1.0 - margin) * shares(name).get(name, 0.0)
        target = min(share, v.effective_limit if owed else v.reserve)
        want = 0
        for n in sizes:
            if v.held + want + n > target:
                break
            want += n
        if want:
            wanted[name] = want
            unused += max(0, v.reserve - v.held)
    if wanted:
        protected = 0 if snap.lend_reserves else snap.protected - unused
        short = max(0, sum(wanted.values()) - (snap.budget - snap.total_held - protected))
    else:
        short = over
    if not short:
        return 0, wanted, []
    excess = [
        (name, v.held - int(entitlement.get(name, 0.0)))
        for name, v in views.items()
        if v.held > int(entitlement.get(name, 0.0))
    ]
    excess.sort(key=lambda item: (-item[1] / views[item[0]].weight, item[0]))
    return short, wanted, excess


@pytest.mark.parametrize("seed", range(12))
def test_reclaim_need_with_many_waiting_models_matches_a_straightforward_computation(
    seed: int,
) -> None:
    rng = random.Random(seed)
    budget = rng.randrange(10**6, 10**9)
    n_models = rng.choice([8, 40, 130])
    configs = {}
    reserved = 0
    for i in range(n_models):
        reserve = rng.randrange(0, budget // n_models) if rng.random() < 0.3 else 0
        reserved += reserve
        limit = rng.choice([None, None, reserve + rng.randrange(1, budget)])
        configs[f"m{i}"] = ModelSettings(reserve, limit, rng.choice([0.5, 1, 2, 3.7, 10]))
    ledger = BudgetLedger(
        budget,
        configs,
        max_waiting_per_model=8,
        max_waiting=10_000,
        lend_reserves=rng.random() < 0.5,
    )
    for name in configs:
        if rng.random() < 0.4:
            ledger.charge(name, rng.randrange(0, 3 * budget // n_models))
    queued: dict[str, list[int]] = defaultdict(list)
    for t in range(4 * n_models):
        name = f"m{rng.randrange(n_models)}"
        n = rng.randrange(1, 4 * budget // n_models)
        if ledger.request(name, n, t, 9.0, 0.0).queued:
            queued[name].append(n)
    assert ledger.grants() == []  # nothing granted after the last request: the queue is as built
    for up_to_share in (False, True):
        for margin in (0.0, 0.1, 0.25):
            need = ledger.reclaim_need(up_to_share=up_to_share, margin=margin)
            got = (need.short, need.wanted, need.excess)
            assert got == reference_reclaim_need(ledger, queued, up_to_share, margin)


@pytest.mark.parametrize("seed", range(20))
def test_the_share_table_gives_each_full_share_of_its_own_water_filling(seed: int) -> None:
    rng = random.Random(seed)
    budget = rng.randrange(10**3, 10**9)
    n_models = rng.choice([3, 8, 40])
    configs = {}
    for i in range(n_models):
        reserve = rng.randrange(0, budget // n_models) if rng.random() < 0.3 else 0
        limit = rng.choice([None, reserve + rng.randrange(0, budget)])
        configs[f"m{i}"] = ModelSettings(reserve, limit, rng.choice([0.5, 1, 2, 3.7]))
    ledger = BudgetLedger(budget, configs, max_waiting=10**5, lend_reserves=rng.random() < 0.5)
    for name in configs:
        if rng.random() < 0.5:
            ledger.charge(name, rng.randrange(0, 3 * budget // n_models))
    for t in range(3 * n_models):
        ledger.request(f"m{rng.randrange(n_models)}", rng.randrange(1, budget), t, 9.0, 0.0)
    book = ledger._book
    table = book.share_table()
    assert table.entitlement == book.entitlements()
    for rec in book.models.values():
        assert table.full_share(rec) == pytest.approx(book.entitlements(rec).get(rec, 0.0))
