"""Growth on demand through a live vqpoold (issue 30): another request starts beside running rows
only once their next growth is backed (the look-ahead holds it otherwise, preempting nobody), a
refused growth preempts the started request cheapest to recompute but never one about to
finish, a preempted row's prompt comes back from the prompt cache on its resume, and every
request's greedy tokens and logprobs equal those of a run never preempted nor held. With
``--reserve auto`` (the worker's default) requests reserve whole once the worker's requests are
measured to use their ``max_tokens``, and grow on demand while they stop early or while their
whole need could never fit the pool."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
from daemon_harness import wait_until
from serving_harness import ServingStack
from vqpool.worker.kv.cache_source import PooledCacheSource
from vqpool.worker.models.loading import load_model
from vqpool.worker.pool.client import PoolClient
from vqpool.worker.sched.growth_forecast import (
    MOST_LOOK_AHEAD_BLOCKS,
    USED_SMOOTHING,
    GrowthForecast,
)
from vqpool.worker.sched.preemption import NEAR_FINISH_STEPS
from vqpool.worker.sched.scheduler import GenerationJob, JobEnd, Scheduler, ScoredToken
from vqpool.worker.testing.launch import DaemonProcess

LLAMA = "builtin:llama"
MODEL = load_model(LLAMA).model
BLOCK = 16
SHORT = [1 + (j * 3) % 200 for j in range(5)]
LONG = [1 + (7 + j * 3) % 200 for j in range(23)]


def scheduler_on(
    source: PooledCacheSource,
    *,
    max_concurrent: int,
    cache_bytes: int = 0,
    headroom: int = BLOCK,
    reserve: str = "on-demand",
) -> Scheduler:
    prompt_cache = (
        source.attach_prompt_cache(owner_prefix="g", max_bytes=cache_bytes) if cache_bytes else None
    )
    return Scheduler(
        MODEL,
        source,
        owner_prefix="g",
        eos_token_ids=frozenset(),
        max_concurrent=max_concurrent,
        max_queue=16,
        queue_timeout=60.0,
        reserve=reserve,
        headroom_slots=headroom,
        prompt_cache=prompt_cache,
        block_size=BLOCK,
    )


def drain(job: GenerationJob) -> tuple[list[ScoredToken], JobEnd]:
    tokens: list[ScoredToken] = []
    while not isinstance(event := job.events.get(timeout=60), JobEnd):
        assert isinstance(event, ScoredToken)
        tokens.append(event)
    return tokens, event


def run(
    source: PooledCacheSource,
    specs: Sequence[tuple[list[int], int]],
    *,
    max_concurrent: int,
    cache_bytes: int = 0,
    reserve: str = "on-demand",
) -> tuple[list[tuple[list[ScoredToken], JobEnd]], list[GenerationJob], dict[str, Any]]:
    """Submit the jobs (prompt, max_tokens) at once, with logprobs, to a started scheduler."""
    scheduler = scheduler_on(
        source, max_concurrent=max_concurrent, cache_bytes=cache_bytes, reserve=reserve
    )
    jobs = [GenerationJob(prompt, n, logprobs=True, top_logprobs=2) for prompt, n in specs]
    # Queued before the generation thread starts: it admits them together (none waits for
    # the look-ahead of a row already decoding).
    for job in jobs:
        scheduler.submit(job)
    scheduler.start()
    try:
        results = [drain(job) for job in jobs]
    finally:
        scheduler.stop()
    return results, jobs, scheduler.stats.snapshot()


def alone(
    pooled: Callable[[int], tuple[PooledCacheSource, DaemonProcess]],
    specs: Sequence[tuple[list[int], int]],
) -> list[tuple[list[ScoredToken], JobEnd]]:
    """The jobs run one at a time in a pool large enough for anything: never preempted."""
    source, _ = pooled(1024)
    results, _, stats = run(source, specs, max_concurrent=1)
    assert stats["preemptions"] == 0 and stats["held_for_growth"] == 0
    return results


def assert_same(
    got: list[tuple[list[ScoredToken], JobEnd]], reference: list[tuple[list[ScoredToken], JobEnd]]
) -> None:
    for (tokens, end), (ref_tokens, ref_end) in zip(got, reference, strict=True):
        assert (end.finish_reason, end.detail) == (ref_end.finish_reason, None)
        assert tokens == ref_tokens


def test_the_look_ahead_holds_an_admission_that_would_fit_and_preempts_nobody(pooled: Any) -> None:
    # The scheduler is driven here, one round at a time, instead of by its thread: the premise
    # (what the pool has free when the second request asks to start) holds exactly.
    first, second = (LONG, 80), (SHORT[:3], 20)
    reference = alone(pooled, [first, second])
    source, daemon = pooled(64)  # 32 blocks per stream
    scheduler = scheduler_on(source, max_concurrent=2, headroom=1)
    jobs = [
        GenerationJob(prompt, n, logprobs=True, top_logprobs=2) for prompt, n in (first, second)
    ]
    scheduler.submit(jobs[0])
    scheduler._admit()
    while jobs[0].events.empty():  # its prefill, then it joins the batch
        scheduler._step()
    with PoolClient(daemon.run_dir, name="hog") as hog:
        # Two blocks per stream stay free: the second request's prompt + 1 slot needs one. The
        # first row, with no row ended yet, must be backed for the most look-ahead blocks.
        for stream in ("k", "v"):
            hog.allocate(stream, (hog.n_free(stream) - 2) * BLOCK, "hog-request")
        assert MOST_LOOK_AHEAD_BLOCKS > 2
        scheduler.submit(jobs[1])
        scheduler._admit()
        stats = scheduler.stats.snapshot()
        assert stats["held_for_growth"] == 1 and stats["waits"] == 0
        assert stats["preemptions"] == 0 and stats["active"] == 1
        assert jobs[1].cache is None  # it never asked the pool
        assert all(hog.n_free(stream) >= 1 for stream in ("k", "v"))
        hog.free_all("hog-request")
    # The hold ends when the running row ends or a block's worth of steps passed.
    while scheduler._active or scheduler._waiting:
        scheduler._admit()
        if scheduler._active:
            scheduler._step()
    scheduler.stop()
    assert_same([drain(job) for job in jobs], reference)
    assert all(job.preemptions == 0 for job in jobs)
    assert source.n_blocks() == 0 and daemon.audit()["blocks_in_use"] == 0


def test_the_victim_is_the_cheapest_to_recompute_unless_it_is_about_to_finish(
    pooled: Any,
) -> None:
    # Together, padded to the longer row, the two outgrow 8 blocks per stream: the short one
    # (fewer tokens to recompute, as many steps left) gives way. Given a max_tokens that ends it
    # a few steps after that refusal, it is spared and the long one gives way instead.
    source, daemon = pooled(16)
    _, jobs, stats = run(source, [(SHORT, 60), (LONG, 60)], max_concurrent=2)
    assert stats["preemptions"] == 1 and [job.preemptions for job in jobs] == [1, 0]
    refused_at = jobs[0].resumed_from  # tokens the short one had made when it gave way
    specs = [(SHORT, refused_at + NEAR_FINISH_STEPS // 2), (LONG, 60)]
    reference = alone(pooled, specs)
    results, jobs, stats = run(source, specs, max_concurrent=2)
    assert jobs[0].preemptions == 0 and jobs[1].preemptions >= 1
    assert_same(results, reference)
    assert source.n_blocks() == 0 and daemon.audit()["blocks_in_use"] == 0


def test_a_preempted_row_resumes_from_its_prompt_in_the_prompt_cache(pooled: Any) -> None:
    # With a prompt cache, the row that gives way keeps its prompt there (the shorter prompt:
    # fewer tokens to recompute), and its resume copies it back and prefills only the rest
    # (the generated tokens). Nothing else shares a prefix: every token reused is the resume's.
    specs = [([1 + (11 + j * 5) % 200 for j in range(40)], 60), (LONG[:20], 60)]
    reference = alone(pooled, specs)
    source, _ = pooled(20)  # 10 blocks per stream
    results, jobs, stats = run(source, specs, max_concurrent=2, cache_bytes=1 << 20)
    assert stats["preemptions"] == 1 and [job.preemptions for job in jobs] == [0, 1], stats
    # Its whole prompt came back (a store keeps a partial last block too).
    assert stats["prompt_cache"]["tokens_reused"] == len(specs[1][0]), stats["prompt_cache"]
    assert_same(results, reference)
    assert source.n_blocks() == 0


def test_the_look_ahead_is_measured_and_doubled_after_a_refusal() -> None:
    forecast = GrowthForecast(BLOCK)
    assert forecast.look_ahead_slots() == MOST_LOOK_AHEAD_BLOCKS * BLOCK  # nothing measured
    for gap in (0, 10, 10):
        for _ in range(gap):
            forecast.stepped()
        forecast.row_ended()
    assert forecast.steps_between_ends == 10
    assert forecast.look_ahead_slots() == 10
    forecast.refused()
    assert forecast.look_ahead_slots() == 20
    for _ in range(11):
        forecast.stepped()
    assert forecast.look_ahead_slots() == 10  # the refusal is older than the horizon
    forecast.hold(running=2)
    assert forecast.holds(running=2)
    assert not forecast.holds(running=1)  # a row ended
    forecast.hold(running=2)
    for _ in range(BLOCK):
        forecast.stepped()
    assert not forecast.holds(running=2)  # a block's worth of steps passed


def test_auto_reserves_whole_once_requests_use_their_max_tokens(pooled: Any) -> None:
    # Nothing measured: the first request starts on demand. It runs to its max_tokens (the
    # built-in model has no EOS), so the next reserves prompt + max_tokens whole, with no
    # look-ahead; once requests are measured to stop early, requests grow on demand again.
    first, second, third = (LONG, 40), (SHORT, 60), (SHORT[:4], 60)
    reference = alone(pooled, [first, second, third])
    source, daemon = pooled(256)
    scheduler = scheduler_on(source, max_concurrent=2, reserve="auto")
    jobs = [
        GenerationJob(prompt, n, logprobs=True, top_logprobs=2)
        for prompt, n in (first, second, third)
    ]

    def start(job: GenerationJob) -> Any:
        scheduler.submit(job)
        scheduler._admit()
        assert job in scheduler._active and job.cache is not None
        return job.cache[0].row

    def finish() -> None:
        while scheduler._active or scheduler._waiting:
            scheduler._admit()
            if scheduler._active:
                scheduler._step()

    assert start(jobs[0]).capacity < len(LONG) + 40 and not jobs[0].whole
    finish()
    assert scheduler._forecast.used == 1.0
    assert start(jobs[1]).capacity >= len(SHORT) + 60 and jobs[1].whole
    finish()
    for _ in range(3):  # three requests that stopped at a tenth of their max_tokens
        scheduler._forecast.request_ended(6, 60)
    assert start(jobs[2]).capacity < len(SHORT[:4]) + 60 and not jobs[2].whole
    finish()
    scheduler.stop()
    stats = scheduler.stats.snapshot()
    assert stats["reserved_whole"] == 1 and stats["admitted"] == 3
    assert_same([drain(job) for job in jobs], reference)
    assert source.n_blocks() == 0 and daemon.audit()["blocks_in_use"] == 0


def test_auto_keeps_reserving_whole_while_requests_wait_for_memory(pooled: Any) -> None:
    # Requests are measured to run to their max_tokens, so the next reserves whole; the one
    # after it cannot start beside it (8 blocks per stream hold one whole reservation of 5) and
    # waits for memory. It and the one after it still reserve whole: on a load whose requests
    # run to their max_tokens growth frees nothing they hold at their end, and its preemptions
    # cost more than the rows it adds (docs/serving.md, bench_reserve).
    specs = [(SHORT, 40), (SHORT, 60), (SHORT[:4], 60), (SHORT[:3], 60)]
    reference = alone(pooled, specs)
    source, daemon = pooled(16)
    scheduler = scheduler_on(source, max_concurrent=2, reserve="auto")
    jobs = [GenerationJob(prompt, n, logprobs=True, top_logprobs=2) for prompt, n in specs]

    def finish() -> None:
        while scheduler._active or scheduler._waiting:
            scheduler._admit()
            if scheduler._active:
                scheduler._step()

    scheduler.submit(jobs[0])
    finish()
    assert scheduler._forecast.used == 1.0
    for job in jobs[1:]:
        scheduler.submit(job)
    scheduler._admit()
    assert jobs[1].whole and jobs[1] in scheduler._active
    assert jobs[2] not in scheduler._active and scheduler.stats.snapshot()["waits"] == 1
    finish()
    scheduler.stop()
    for job, (prompt, max_tokens) in zip(jobs[2:], specs[2:], strict=True):
        assert job.whole and job.admission_slots >= len(prompt) + max_tokens
    assert scheduler.stats.snapshot()["preemptions"] == 0
    assert_same([drain(job) for job in jobs], reference)
    assert source.n_blocks() == 0 and daemon.audit()["blocks_in_use"] == 0


def test_auto_grows_a_request_whose_whole_need_the_pool_could_never_hold(pooled: Any) -> None:
    # Requests are measured to run to their max_tokens, but one asks for more than the pool's
    # 128 slots per stream: reserved whole it would wait until its queue timeout; it starts on
    # demand instead and runs until the pool runs out, as with --reserve on-demand.
    source, daemon = pooled(16)  # 8 blocks per stream
    scheduler = scheduler_on(source, max_concurrent=1, reserve="auto")
    measured, too_long, fits = (GenerationJob(SHORT, n, logprobs=True) for n in (40, 200, 60))
    for job in (measured, too_long, fits):
        scheduler.submit(job)
    scheduler.start()
    try:
        ends = [drain(job)[1] for job in (measured, too_long, fits)]
    finally:
        scheduler.stop()
    assert scheduler._forecast.used == 1.0
    assert [job.whole for job in (measured, too_long, fits)] == [False, False, True]
    assert [end.finish_reason for end in ends] == ["length"] * 3
    assert ends[1].detail is not None and "ran out of blocks" in ends[1].detail, ends[1]
    assert 0 < ends[1].completion_tokens < 200
    assert (ends[0].completion_tokens, ends[2].completion_tokens) == (40, 60)
    assert source.n_blocks() == 0 and daemon.audit()["blocks_in_use"] == 0


def test_a_worker_reserves_per_request_by_default() -> None:
    # A worker started without --reserve: its first request grows on demand (nothing measured
    # yet) and runs to max_tokens (the built-in model has no EOS), so the next ones are reserved
    # whole; two that stop early (at a stop string) bring growth on demand back.
    stack = ServingStack([LLAMA]).start()
    try:
        body = {"prompt": "per request: ", "max_tokens": 60, "temperature": 0}

        def complete(**fields: Any) -> dict[str, Any]:
            ended = sum(stack.worker_stats(LLAMA)[f"ended_{r}"] for r in ("stop", "length"))
            reply = stack.complete(LLAMA, {**body, **fields})
            assert reply.status == 200, reply
            # The request's end is measured before the next one starts (a stop string ends
            # the response before the scheduler ends the request).
            wait_until(
                lambda: (
                    sum(stack.worker_stats(LLAMA)[f"ended_{r}"] for r in ("stop", "length")) > ended
                ),
                timeout=10,
            )
            stats: dict[str, Any] = stack.worker_stats(LLAMA)
            return {"reply": reply.body["choices"][0], **stats}

        first = complete()
        assert first["reply"]["finish_reason"] == "length"
        assert (first["admitted"], first["reserved_whole"]) == (1, 0)
        assert complete()["reserved_whole"] == 1
        stop = first["reply"]["text"][2:4]  # reached a few tokens in
        stopped = [complete(stop=[stop]) for _ in range(2)]
        assert all(s["reply"]["finish_reason"] == "stop" for s in stopped), stopped
        assert stopped[-1]["reserved_whole"] == 3  # still whole: the average was 1.0
        grown = complete()
        assert (grown["admitted"], grown["reserved_whole"]) == (5, 3)
        assert grown["ended_length"] == 3 and grown["preemptions"] == 0
        stack.wait_for_no_blocks()
    finally:
        stack.stop()


def test_the_share_of_max_tokens_used_is_a_moving_average() -> None:
    forecast = GrowthForecast(BLOCK)
    assert forecast.used is None
    forecast.request_ended(10, 10)
    assert forecast.used == 1.0
    forecast.request_ended(0, 10)
    assert forecast.used == pytest.approx(1.0 - USED_SMOOTHING)
    forecast.request_ended(30, 10)  # never more than all of it
    assert forecast.used == pytest.approx(1.0 - USED_SMOOTHING + USED_SMOOTHING**2)


def test_stats_say_whether_the_cap_or_the_pool_kept_requests_waiting(pooled: Any) -> None:
    # Two whole reservations of 5 blocks per stream each, submitted together. With room for
    # both and one allowed to run, the second waits for --max-concurrent; with two allowed and
    # room for one, it waits for memory.
    specs = [(SHORT, 60), (SHORT, 60)]
    source, _ = pooled(256)
    _, _, capped = run(source, specs, max_concurrent=1, reserve="full")
    assert capped["queued_at_most_seconds"] > 0 and capped["queued_below_most_seconds"] == 0
    assert capped["row_seconds"] > 0 and capped["block_seconds"] > 0
    source, daemon = pooled(16)  # 8 blocks per stream
    _, _, short = run(source, specs, max_concurrent=2, reserve="full")
    assert short["queued_below_most_seconds"] > 0 and short["queued_at_most_seconds"] == 0
    assert short["waits"] == 1 and short["preemptions"] == 0
    assert source.n_blocks() == 0 and daemon.audit()["blocks_in_use"] == 0


def test_a_refused_look_ahead_is_not_asked_again_at_the_next_block(pooled: Any) -> None:
    # A lone row decodes with two blocks per stream left free: at its next block boundary the
    # look-ahead (the most blocks: no row ended yet) is refused and the row grows one block; at
    # the boundary after it the look-ahead is not asked again (it would be refused the same
    # way, a pool call), and the row grows its one block directly.
    spec = (LONG, 60)
    reference = alone(pooled, [spec])
    source, daemon = pooled(64)  # 32 blocks per stream
    scheduler = scheduler_on(source, max_concurrent=1, headroom=1)
    job = GenerationJob(spec[0], spec[1], logprobs=True, top_logprobs=2)
    scheduler.submit(job)
    scheduler._admit()
    while job.events.empty():  # its prefill, then it joins the batch
        scheduler._step()
    with PoolClient(daemon.run_dir, name="hog") as hog:
        for stream in ("k", "v"):
            hog.allocate(stream, (hog.n_free(stream) - 2) * BLOCK, "hog-request")
        refused_before = hog.stats.n_exhausted
        # Through its next block boundary (the batch's length starts below 2 blocks), then
        # the one after it.
        while scheduler._batch.used_slots() < 2 * BLOCK + 1:
            scheduler._step()
        refused = hog.stats.n_exhausted - refused_before  # a pool call's K and V requests
        assert refused > 0
        while scheduler._batch.used_slots() < 3 * BLOCK + 1:
            scheduler._step()
        assert hog.stats.n_exhausted - refused_before == refused
        assert all(hog.n_free(stream) == 0 for stream in ("k", "v"))
        assert scheduler.stats.snapshot()["preemptions"] == 0
        hog.free_all("hog-request")
    while scheduler._active:
        scheduler._step()
    scheduler.stop()
    assert_same([drain(job)], reference)
    assert source.n_blocks() == 0 and daemon.audit()["blocks_in_use"] == 0
