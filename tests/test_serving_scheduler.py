"""The scheduler in-process: a generation thread that dies must not leave the worker taking
requests nobody will run (each would wait for tokens until its client gave up)."""

from __future__ import annotations

from typing import Any

import pytest
from vqpool.worker.kv.cache_source import StockCacheSource
from vqpool.worker.models.loading import load_model
from vqpool.worker.sched.scheduler import GenerationJob, JobEnd, Scheduler, ShuttingDownError


class FailingOnce(StockCacheSource):
    """Stock caches whose ``nbytes`` fails on its ``fail_at``-th call: the scheduler reads it
    outside any job's error handling at the end of a decode round, so the thread dies there."""

    def __init__(self, model: Any, fail_at: int) -> None:
        super().__init__(model)
        self.calls = 0
        self.fail_at = fail_at

    def nbytes(self) -> int:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected failure")
        return super().nbytes()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_generation_thread_refuses_new_requests() -> None:
    loaded = load_model("builtin:llama")
    # Call 1: the job's admission; call 2: the end of the first decode round.
    scheduler = Scheduler(
        loaded.model,
        FailingOnce(loaded.model, fail_at=2),
        owner_prefix="test",
        eos_token_ids=frozenset(),
        max_concurrent=1,
        max_queue=4,
        queue_timeout=5.0,
    )
    scheduler.start()
    try:
        job = GenerationJob([1, 2, 3], max_tokens=50)
        scheduler.submit(job)
        events = [job.events.get(timeout=30)]
        while not isinstance(events[-1], JobEnd):
            events.append(job.events.get(timeout=30))
        end = events[-1]
        assert isinstance(end, JobEnd) and end.finish_reason == "error" and end.status == 503
        with pytest.raises(ShuttingDownError, match="generation thread failed"):
            scheduler.submit(GenerationJob([1, 2, 3], max_tokens=5))
    finally:
        scheduler.stop()
