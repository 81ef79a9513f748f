"""AdmissionWaiter: one parked allocation at a time, its outcome handed to the generation
thread, and blocks granted after the job went away freed, never handed over."""

from __future__ import annotations

import threading
from typing import Any

from vqpool.shared.errors import BlockPoolExhaustedError
from vqpool.worker.kv.cache_source import StockCacheSource
from vqpool.worker.sched.admission import AdmissionWaiter


class GatedSource(StockCacheSource):
    """A source whose ``take`` returns ``answer`` once ``release`` is set (as a daemon that
    grants a parked request when bytes are freed)."""

    waits = True

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.release = threading.Event()
        self.taking = threading.Event()
        self.freed: list[Any] = []
        self.asked: list[tuple[int, float]] = []

    def take(
        self, cache: list[Any], n_tokens: int, wait: float, cancel: threading.Event | None = None
    ) -> Any:
        self.asked.append((n_tokens, wait))
        self.taking.set()
        self.release.wait(10)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    def free_taken(self, taken: Any) -> None:
        self.freed.append(taken)


def test_a_granted_outcome_goes_to_the_generation_thread() -> None:
    source = GatedSource(answer=("k-blocks", "v-blocks"))
    woken = threading.Event()
    waiter = AdmissionWaiter(source, woken.set)
    job = object()
    waiter.park(job, [], 128, 5.0)
    assert source.taking.wait(5)
    assert waiter.busy and waiter.outcome(job) is None
    source.release.set()
    assert woken.wait(5)
    outcome = waiter.outcome(job)
    assert outcome is not None and outcome.taken == ("k-blocks", "v-blocks")
    assert source.asked == [(128, 5.0)] and source.freed == []
    assert not waiter.busy
    waiter.stop()


def test_blocks_granted_after_the_job_was_abandoned_are_freed() -> None:
    source = GatedSource(answer=("k-blocks", "v-blocks"))
    woken = threading.Event()
    waiter = AdmissionWaiter(source, woken.set)
    job = object()
    waiter.park(job, [], 64, 5.0)
    assert source.taking.wait(5)
    waiter.abandon(job)
    assert waiter.busy  # its call is still parked: the next head must not park meanwhile
    source.release.set()
    assert woken.wait(5)
    assert source.freed == [("k-blocks", "v-blocks")]
    assert waiter.outcome(job) is None and not waiter.busy
    waiter.stop()


def test_a_wait_that_ran_out_is_reported_as_exhausted() -> None:
    source = GatedSource(answer=BlockPoolExhaustedError("waited 5s"))
    source.release.set()
    woken = threading.Event()
    waiter = AdmissionWaiter(source, woken.set)
    job = object()
    waiter.park(job, [], 64, 5.0)
    assert woken.wait(5)
    outcome = waiter.outcome(job)
    assert outcome is not None and outcome.exhausted and outcome.taken is None
    waiter.stop()
