"""Growth requests in the byte budget ledger (daemon/budget/ledger.py): a growth of held memory goes
ahead of its model's waiting admissions, waits only while its model is owed it (below its fair
share), and at most one growth of each party waits; the queue's invariants hold throughout. And
the worker's bound on how long a step's growths may wait (``--growth-wait``)."""

from __future__ import annotations

import random

import pytest
from vqpool.daemon.budget.ledger import BudgetLedger, ModelSettings, Outcome, Reason
from vqpool.worker.serve import build_parser


def full_ledger() -> BudgetLedger:
    """Budget 100: model a (weight 2) holds 50 and waits with an admission of 20; model b
    (weight 1) holds 50. a's fair share is 2/3 of the budget, b's 1/3."""
    ledger = BudgetLedger(
        100, {"a": ModelSettings(weight=2.0), "b": ModelSettings(weight=1.0)}, lend_reserves=True
    )
    assert ledger.try_grant("a", 50).outcome is Outcome.GRANT
    assert ledger.try_grant("b", 50).outcome is Outcome.GRANT
    assert ledger.request("a", 20, "admit-a", 10.0, 0.0).queued
    ledger.check_invariants()
    return ledger


def test_a_growth_is_not_stuck_behind_its_own_models_admission() -> None:
    ledger = full_ledger()
    ledger.credit("b", 10)  # 10 free: too few for the admission of 20
    assert ledger.grants() == []
    # Without the flag a growth waits behind its model's admission (the old deadlock).
    plain = ledger.try_grant("a", 10)
    assert plain.outcome is Outcome.WAIT and plain.reason is Reason.BEHIND_WAITERS
    assert ledger.try_grant("a", 10, growth=True).outcome is Outcome.GRANT
    assert ledger.held("a") == 60
    ledger.check_invariants()


def test_a_growth_waits_ahead_of_admissions_and_counts_as_demand() -> None:
    ledger = full_ledger()
    verdict = ledger.request("a", 10, "grow-a", 0.2, 0.0, growth="session-1")
    assert verdict.queued and verdict.outcome is Outcome.WAIT
    view = ledger.snapshot().models["a"]
    assert (view.waiting, view.waiting_bytes) == (2, 30)
    ledger.check_invariants()
    # a is below its share (66) and b above its (33): reclaim is planned for the growth first.
    need = ledger.reclaim_need()
    assert need.wanted == {"a": 10} and need.short == 10
    assert [name for name, _ in need.excess] == ["b"]
    ledger.credit("b", 10)
    assert ledger.grants() == ["grow-a"]  # the growth, not the older admission
    assert ledger.held("a") == 60 and ledger.is_waiting("admit-a")
    ledger.check_invariants()


def test_a_growth_above_its_share_is_answered_at_once() -> None:
    ledger = full_ledger()
    before = (ledger.snapshot(now=0.0), ledger.next_deadline())
    verdict = ledger.request("b", 10, "grow-b", 0.2, 0.0, growth="session-2")
    assert verdict.outcome is Outcome.WAIT and not verdict.queued
    assert verdict.reason is Reason.ABOVE_SHARE and "fair share" in verdict.message()
    assert (ledger.snapshot(now=0.0), ledger.next_deadline()) == before
    ledger.check_invariants()


def test_one_growth_per_party_waits_and_others_queue_behind_growths() -> None:
    ledger = full_ledger()
    assert ledger.request("a", 5, "g1", 0.2, 0.0, growth="s1").queued
    second = ledger.request("a", 5, "g2", 0.2, 0.0, growth="s1")
    assert not second.queued and second.reason is Reason.GROWTH_WAITING
    assert ledger.request("a", 5, "g3", 0.2, 0.0, growth="s2").queued
    ledger.check_invariants()
    ledger.credit("b", 10)
    assert ledger.grants() == ["g1", "g3"]
    assert ledger.is_waiting("admit-a")
    # Its first growth served, the party may wait with another.
    assert ledger.request("a", 5, "g4", 0.2, 0.0, growth="s1").queued
    ledger.check_invariants()


def test_a_growth_leaves_by_expiry_and_cancel_and_frees_its_party() -> None:
    ledger = full_ledger()
    assert ledger.request("a", 5, "g1", 0.2, 0.0, growth="s1").queued
    assert ledger.expire(0.2) == ["g1"]
    ledger.check_invariants()
    assert ledger.request("a", 5, "g2", 0.4, 0.2, growth="s1").queued
    assert ledger.cancel("g2")
    ledger.check_invariants()
    assert ledger.request("a", 5, "g3", 0.6, 0.4, growth="s1").queued
    ledger.check_invariants()


def test_growths_are_bounded_by_the_queues() -> None:
    ledger = BudgetLedger(100, max_waiting_per_model=2, max_waiting=3, lend_reserves=True)
    assert ledger.try_grant("a", 40).outcome is Outcome.GRANT
    assert ledger.try_grant("b", 60).outcome is Outcome.GRANT
    assert ledger.request("a", 5, "g1", 1.0, 0.0, growth=1).queued
    assert ledger.request("a", 5, "g2", 1.0, 0.0, growth=2).queued
    full = ledger.request("a", 5, "g3", 1.0, 0.0, growth=3)
    assert full.outcome is Outcome.QUEUE_FULL and full.reason is Reason.MODEL_QUEUE_FULL
    ledger.check_invariants()


def test_random_growths_admissions_credits_keep_the_invariants() -> None:
    rng = random.Random(13)
    for _ in range(20):
        models = {
            name: ModelSettings(reserve=rng.choice([0, 10, 20]), weight=rng.choice([1.0, 2.0]))
            for name in ("a", "b", "c")
        }
        ledger = BudgetLedger(
            100, models, lend_reserves=rng.random() < 0.5, max_waiting_per_model=4
        )
        held = {name: 0 for name in models}
        tickets: dict[object, tuple[str, int]] = {}
        now = 0.0
        for step in range(300):
            now += rng.random() * 0.05
            name = rng.choice(list(models))
            n = rng.choice([0, 5, 10, 25])
            action = rng.random()
            if action < 0.3:
                ticket = ("g", step)
                verdict = ledger.request(
                    name, n, ticket, now + 0.2, now, growth=(name, rng.randrange(2))
                )
            elif action < 0.5:
                ticket = ("a", step)
                verdict = ledger.request(name, n, ticket, now + 1.0, now)
            elif action < 0.6:
                ticket = None
                verdict = ledger.try_grant(name, n, growth=rng.random() < 0.5)
            else:
                ticket = None
                verdict = None
                if held[name]:
                    give = rng.randint(1, held[name])
                    ledger.credit(name, give)
                    held[name] -= give
                for expired in ledger.expire(now):
                    tickets.pop(expired)
                if tickets and rng.random() < 0.2:
                    victim = rng.choice(list(tickets))
                    assert ledger.cancel(victim)
                    tickets.pop(victim)
            if verdict is not None:
                if verdict.outcome is Outcome.GRANT:
                    held[name] += n
                elif verdict.queued:
                    assert ticket is not None
                    tickets[ticket] = (name, n)
            for granted in ledger.grants():
                granted_name, granted_n = tickets.pop(granted)
                held[granted_name] += granted_n
            ledger.check_invariants()
            assert ledger.total_held <= ledger.budget
            assert all(ledger.held(m) == held[m] for m in models)


def test_the_workers_growth_wait_option_is_bounded() -> None:
    base = ["--model", "builtin:llama", "--port", "0"]
    assert build_parser().parse_args(base).growth_wait == 0.1
    assert build_parser().parse_args([*base, "--growth-wait", "0"]).growth_wait == 0.0
    for bad in ("-0.1", "5.5", "soon", "nan"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*base, "--growth-wait", bad])
