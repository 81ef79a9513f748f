"""The scheduler's answer to a reclaim ask (``Scheduler.give_back``), on a real tiny MLX model
and a live vqpoold: the prompt cache gives first, and running requests are preempted for the
rest, so the worker gives back at least what it was asked even when its cache covers only part
of the ask (issue 23, finding 13: the cache's bytes were counted twice)."""

from __future__ import annotations

import time
from collections.abc import Callable

from vqpool.worker.models.loading import load_model
from vqpool.worker.run_worker import open_pool
from vqpool.worker.sched.scheduler import GenerationJob, JobEnd, Scheduler
from vqpool.worker.testing.launch import DaemonProcess

MODEL = load_model("builtin:llama").model
BLOCK_PAIR_BYTES = 2 * 4096  # builtin:llama: K and V of one block of 16 slots
CACHED_PROMPT = [1 + (j * 7) % 200 for j in range(150)]
RUNNING_PROMPT = [1 + (j * 5) % 190 for j in range(20)]
RUNNING_TOKENS = 1000


def test_a_reclaim_partly_covered_by_the_prompt_cache_preempts_for_the_rest(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    daemon = start_daemon("--n-blocks", "1024")
    pool, source = open_pool(str(daemon.run_dir), "reclaim", MODEL, 5.0)
    cache = source.attach_prompt_cache(owner_prefix="r", max_bytes=1 << 30)
    scheduler = Scheduler(
        MODEL,
        source,
        owner_prefix="r",
        eos_token_ids=frozenset(),
        max_concurrent=2,
        max_queue=4,
        queue_timeout=30.0,
        prompt_cache=cache,
    )
    scheduler.start()
    try:
        first = GenerationJob(CACHED_PROMPT, 10)
        scheduler.submit(first)
        while not isinstance(first.events.get(timeout=60), JobEnd):
            pass
        cached = cache.nbytes  # its KV, kept in the prompt cache
        assert cached >= 4 * BLOCK_PAIR_BYTES
        running = GenerationJob(RUNNING_PROMPT, RUNNING_TOKENS)
        scheduler.submit(running)
        running.events.get(timeout=60)  # its first token: it runs (for ~1,000 steps more)
        before = pool.held_bytes()
        ask = cached + BLOCK_PAIR_BYTES  # more than the cache holds
        scheduler.give_back(ask, time.monotonic() + 10)
        freed = before - pool.held_bytes()
        assert cache.nbytes == 0
        assert running.preemptions == 1, (running.n_generated, freed, ask)
        assert freed >= ask, (freed, ask)
        while not isinstance(end := running.events.get(timeout=60), JobEnd):
            pass
        # Preempted, resumed, whole: it ran to its end after the ask was answered.
        assert (end.finish_reason, end.completion_tokens) == ("length", RUNNING_TOKENS)
    finally:
        scheduler.stop()
        cache.drop()
        pool.close()
    assert daemon.audit()["blocks_in_use"] == 0
