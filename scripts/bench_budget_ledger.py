#!/usr/bin/env python3
"""Cost of the byte budget's checks (daemon/budget/ledger.py) on the allocation path.

Prints the median of several runs, in ns per call, of:

- ``try_grant`` + ``credit`` while nobody waits (the hot path: every allocate and free);
- the same pair with 1,000 models configured (it must not grow with the number of models);
- ``allocate(1 block)`` + ``free`` of the allocator, the work the check sits next to, and the
  ratio of the two (the daemon's allocate round trip is ~50-100 us more on top);
- ``request`` of a model that must wait while other models' requests wait (the slow path);
- ``credit`` + ``grants()`` handing one waiting request out with 8 models waiting;
- one reclaim plan (``plan_reclaim``: what the daemon's loop computes when it plans asks) with
  8, 128 and 512 models waiting, each for one request, while one model holds the budget.

    scripts/bench_budget_ledger.py            # full run, a few seconds
    scripts/bench_budget_ledger.py --quick    # a smoke run of every measurement
"""

from __future__ import annotations

import argparse
import gc
import itertools
import math
import statistics
import time
from collections.abc import Callable, Hashable

from vqpool.daemon.budget.ledger import BudgetLedger, ModelSettings
from vqpool.daemon.budget.reclaim_book import ReclaimBook, plan_reclaim
from vqpool.shared import BlockPoolAllocator, PoolConfig

GiB = 2**30
BLOCK_BYTES = 2 * 16 * 8 * 128 * 2  # k or v of 16 tokens, 8 layers, 1 head of 128 fp16 dims


def per_call_ns(loops: int, runs: int, make: Callable[[], Callable[[int], None]]) -> float:
    """Median over ``runs`` of ns per loop iteration of the body ``make()`` returns (GC off)."""
    results = []
    for _ in range(runs):
        body = make()
        body(10)  # warm up
        gc.disable()
        try:
            start = time.perf_counter_ns()
            body(loops)
            results.append((time.perf_counter_ns() - start) / loops)
        finally:
            gc.enable()
    return statistics.median(results)


def ledger_with(n_models: int) -> BudgetLedger:
    """A 64 GiB budget with ``n_models`` configured models, a few with reserves, some held."""
    models = {
        f"model-{i}": ModelSettings(reserve=GiB // 8 if i % 4 == 0 else 0, weight=1 + i % 3)
        for i in range(n_models)
    }
    ledger = BudgetLedger(64 * GiB, models)
    for i in range(0, n_models, 2):
        ledger.charge(f"model-{i}", GiB // 64)
    return ledger


def grant_credit(n_models: int) -> Callable[[], Callable[[int], None]]:
    def make() -> Callable[[int], None]:
        ledger = ledger_with(n_models)
        try_grant, credit = ledger.try_grant, ledger.credit
        model = "model-1"

        def body(loops: int) -> None:
            for _ in range(loops):
                try_grant(model, BLOCK_BYTES)
                credit(model, BLOCK_BYTES)

        return body

    return make


def allocate_free() -> Callable[[int], None]:
    pool = BlockPoolAllocator(PoolConfig(n_blocks=4096))
    allocate, free = pool.allocate, pool.free

    def body(loops: int) -> None:
        for _ in range(loops):
            free(allocate("k", 1, 1))

    return body


def full_ledger_with_waiters(n_waiting_models: int, max_waiting: int = 1024) -> BudgetLedger:
    ledger = BudgetLedger(GiB, max_waiting_per_model=max_waiting, max_waiting=2 * max_waiting)
    ledger.charge("holder", GiB)
    for i in range(n_waiting_models):
        ledger.request(f"waiter-{i}", BLOCK_BYTES, ("w", i), math.inf, 0.0)
    ledger.grants()
    return ledger


def request_waits(loops: int) -> Callable[[], Callable[[int], None]]:
    """A model that does not wait yet asks while 8 others wait and the budget is full."""

    def make() -> Callable[[int], None]:
        ledger = full_ledger_with_waiters(8, max_waiting=loops + 10)
        request = ledger.request
        models = iter([f"newcomer-{i}" for i in range(loops + 10)])

        def body(n: int) -> None:
            for _ in range(n):
                model = next(models)
                request(model, BLOCK_BYTES, model, math.inf, 0.0)

        return body

    return make


def credit_grants() -> Callable[[int], None]:
    ledger = full_ledger_with_waiters(8)
    credit, grants, request = ledger.credit, ledger.grants, ledger.request
    model_of: dict[Hashable, str] = {("w", i): f"waiter-{i}" for i in range(8)}
    numbers = itertools.count()

    def body(loops: int) -> None:
        for _ in range(loops):
            credit("holder", BLOCK_BYTES)
            (ticket,) = grants()
            # Put the same bytes back in play: the granted model frees them to the holder and
            # asks again, so 8 models keep waiting.
            model = model_of.pop(ticket)
            credit(model, BLOCK_BYTES)
            ledger.charge("holder", BLOCK_BYTES)
            again = ("again", next(numbers))
            model_of[again] = model
            request(model, BLOCK_BYTES, again, math.inf, 0.0)

    return body


def reclaim_plan(n_waiting_models: int) -> Callable[[], Callable[[int], None]]:
    """One reclaim plan with ``n_waiting_models`` models waiting after a change of holdings (no
    session to ask: the plan is computed in full every time, nothing is asked)."""

    def make() -> Callable[[int], None]:
        ledger = BudgetLedger(
            GiB, max_waiting_per_model=4, max_waiting=n_waiting_models + 10, lend_reserves=True
        )
        ledger.charge("holder", GiB)
        for i in range(n_waiting_models):
            ledger.request(f"waiter-{i}", BLOCK_BYTES * (1 + i % 7), ("w", i), math.inf, 0.0)
        book = ReclaimBook()

        def holders(models: object) -> dict[str, list[tuple[int, int]]]:
            return {}

        def body(loops: int) -> None:
            for _ in range(loops):
                # A byte held and given back: a change, so every plan is computed anew.
                ledger.charge("holder", 1)
                ledger.credit("holder", 1)
                plan_reclaim(ledger, book, holders, 0.0)

        return body

    return make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny loop counts: a smoke run")
    args = parser.parse_args()
    loops, runs = (200, 1) if args.quick else (200_000, 7)
    slow_loops = loops // 10 or 1

    hot_3 = per_call_ns(loops, runs, grant_credit(3))
    hot_1000 = per_call_ns(loops, runs, grant_credit(1000))
    alloc = per_call_ns(loops, runs, lambda: allocate_free())
    print(f"try_grant+credit, nobody waits, 3 models:      {hot_3:8.0f} ns")
    print(f"try_grant+credit, nobody waits, 1000 models:   {hot_1000:8.0f} ns")
    print(f"allocator allocate(1 block)+free (for scale):  {alloc:8.0f} ns")
    print(f"  ledger / allocator:                          {hot_3 / alloc:8.2f}x")
    print(f"  ledger / a 50 us allocate round trip:        {hot_3 / 50_000:8.2%}")
    slow = per_call_ns(slow_loops, runs, request_waits(slow_loops))
    print(f"request that must wait, 8 models waiting:      {slow:8.0f} ns")
    handout = per_call_ns(slow_loops, runs, lambda: credit_grants())
    print(f"credit+grants()+re-request, 8 models waiting:  {handout:8.0f} ns")
    for n_waiting in (8, 128, 512):
        plan_loops = max(1, min(slow_loops, 200_000 // n_waiting**2))
        plan_ns = per_call_ns(plan_loops, min(runs, 3), reclaim_plan(n_waiting))
        print(f"reclaim plan, {n_waiting:3d} models waiting:             {plan_ns / 1e6:8.3f} ms")


if __name__ == "__main__":
    main()
