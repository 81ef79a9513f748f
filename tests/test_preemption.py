"""Preemption instead of failing, through a live vqpoold: when the pool refuses a growth step the
request cheapest to recompute gives way (its blocks back), waits at the head of the queue, and
on resume its KV is recomputed; its client sees one response whose greedy tokens and logprobs
equal a run that was never preempted, streamed or not, and no request ends early because the
pool was short."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from serving_harness import ServingStack, builtin_weights
from vqpool.shared.errors import BlockPoolExhaustedError
from vqpool.worker.kv.cache_source import PooledCacheSource
from vqpool.worker.kv.prompt_cache import PromptCache
from vqpool.worker.models.loading import load_model
from vqpool.worker.pool.client import PoolClient
from vqpool.worker.sched.scheduler import GenerationJob, JobEnd, Scheduler, ScoredToken
from vqpool.worker.testing.http_client import stream_events
from vqpool.worker.testing.launch import DaemonProcess

LLAMA = "builtin:llama"
MODEL = load_model(LLAMA).model
BLOCK = 16  # token slots per block (the daemon's default)
# Alone, each fits 8 blocks per stream (65 and 83 slots: 5 and 6 blocks); together, padded to
# the longer row, they outgrow it after ~40 tokens: the short one, cheaper to recompute (no
# prompt cache: its prompt and generated tokens) with as many steps left, is preempted.
SHORT = [1 + (j * 3) % 200 for j in range(5)]
LONG = [1 + (7 + j * 3) % 200 for j in range(23)]


def run(
    source: PooledCacheSource,
    specs: Sequence[tuple[list[int], int]],
    *,
    max_concurrent: int,
    reserve: str = "on-demand",
    model: Any = MODEL,
    prompt_cache: PromptCache | None = None,
) -> tuple[list[tuple[list[ScoredToken], JobEnd]], list[GenerationJob], dict[str, Any]]:
    """Submit the jobs (prompt, max_tokens) at once with logprobs to a scheduler of ``model``
    over ``source`` (with ``prompt_cache``); their events, the jobs and the scheduler's stats
    at the end."""
    scheduler = Scheduler(
        model,
        source,
        owner_prefix="p",
        eos_token_ids=frozenset(),
        max_concurrent=max_concurrent,
        max_queue=16,
        queue_timeout=60.0,
        reserve=reserve,
        headroom_slots=BLOCK,
        prompt_cache=prompt_cache,
    )
    jobs = [GenerationJob(prompt, n, logprobs=True, top_logprobs=2) for prompt, n in specs]
    # Queued before the generation thread starts: it admits them together (none waits for
    # the look-ahead of a row already decoding).
    for job in jobs:
        scheduler.submit(job)
    scheduler.start()
    try:
        results = []
        for job in jobs:
            tokens: list[ScoredToken] = []
            while not isinstance(event := job.events.get(timeout=60), JobEnd):
                assert isinstance(event, ScoredToken)
                tokens.append(event)
            results.append((tokens, event))
    finally:
        scheduler.stop()
    return results, jobs, scheduler.stats.snapshot()


def assert_nothing_left(source: PooledCacheSource, daemon: DaemonProcess) -> None:
    assert source.n_blocks() == 0
    report = daemon.audit()
    assert report["blocks_in_use"] == 0, report


def test_preempted_requests_resume_with_identical_tokens_and_logprobs(pooled: Any) -> None:
    specs = [(SHORT, 60), (LONG, 60)]
    big, big_daemon = pooled(1024)
    alone, _, alone_stats = run(big, specs, max_concurrent=1)
    assert alone_stats["preemptions"] == 0
    assert_nothing_left(big, big_daemon)
    source, daemon = pooled(16)  # 8 blocks per stream
    results, jobs, stats = run(source, specs, max_concurrent=2)
    assert stats["preemptions"] >= 1 and jobs[0].preemptions >= 1 and jobs[1].preemptions == 0
    assert stats["exhaustions"] == 0
    for (tokens, end), (ref_tokens, _), (_, n) in zip(results, alone, specs, strict=True):
        # Nothing ended early for lack of blocks; nothing was sent twice.
        assert (end.finish_reason, end.detail, end.completion_tokens) == ("length", None, n)
        assert [t.token for t in tokens] == [t.token for t in ref_tokens]
        assert [t.logprob for t in tokens] == [t.logprob for t in ref_tokens]
        assert [t.top for t in tokens] == [t.top for t in ref_tokens]
    assert_nothing_left(source, daemon)


def test_a_preempted_request_resumes_at_the_head_of_the_queue(pooled: Any) -> None:
    # The third request waits behind the two running ones; the cheaper of those (the short
    # one) is preempted and starts again (a new cache, a new owner id) before the third starts.
    source, daemon = pooled(16)
    specs = [(SHORT, 60), (LONG, 60), (SHORT[:3], 10)]
    results, jobs, _ = run(source, specs, max_concurrent=2)
    # Owner ids are numbered in start order: the second's second start was the third start.
    assert jobs[0].preemptions == 1 and jobs[0].owner == "p-3"
    assert jobs[2].owner is not None and int(jobs[2].owner.rsplit("-", 1)[1]) >= 4
    assert all(end.finish_reason == "length" and end.detail is None for _, end in results)
    assert [len(tokens) for tokens, _ in results] == [n for _, n in specs]
    assert_nothing_left(source, daemon)


def test_full_reserve_no_longer_ends_a_short_request_for_its_padding(pooled: Any) -> None:
    # With --reserve full each reserves its own prompt + max_tokens, but beside the long one
    # the short one's row is padded past that: the pool is short, and a request is preempted
    # instead of ending early with "length".
    source, daemon = pooled(16)
    results, _, stats = run(source, [(LONG, 60), (SHORT, 40)], max_concurrent=2, reserve="full")
    assert [(end.finish_reason, end.detail) for _, end in results] == [("length", None)] * 2
    assert [len(tokens) for tokens, _ in results] == [60, 40]
    assert stats["exhaustions"] == 0
    assert_nothing_left(source, daemon)


def _completion(stack: ServingStack, prompt: list[int], stream: bool) -> tuple[list[int], list]:
    """(token ids, logprob entries) of one greedy completion, streamed or not."""
    body = {
        "prompt": prompt,
        "max_tokens": 60,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "return_token_ids": True,
    }
    if not stream:
        reply = stack.complete(LLAMA, body)
        assert reply.status == 200, reply
        choice = reply.body["choices"][0]
        assert choice["finish_reason"] == "length", choice
        return choice["token_ids"], choice["logprobs"]["content"]
    tokens: list[int] = []
    entries: list[dict[str, Any]] = []
    events = list(stream_events(stack.url(LLAMA), "/v1/completions", {**body, "stream": True}))
    for event in events:
        choice = event["choices"][0]
        tokens += choice.get("token_ids") or []
        entries += (choice.get("logprobs") or {}).get("content") or []
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    return tokens, entries


@pytest.fixture(scope="module")
def small_pool_stack() -> Iterator[ServingStack]:
    # --reserve prompt: with on-demand, the newer request would not start beside the older one
    # until the older one's next growth is backed (test_growth_on_demand.py), and nothing would
    # be preempted. The newer one is the one preempted: its prompt (a block or more) is in the
    # prompt cache, and it generated fewer tokens than the older one: less to recompute.
    stack = ServingStack(
        [LLAMA],
        daemon_args=("--n-blocks", "16", "--lease", "1"),
        worker_args=["--max-concurrent", "2", "--queue-timeout", "30", "--reserve", "prompt"],
    ).start()
    yield stack
    stack.stop()


@pytest.mark.parametrize("preempted_streams", [False, True])
def test_a_preempted_http_response_equals_an_unpreempted_one(
    small_pool_stack: ServingStack, preempted_streams: bool
) -> None:
    stack = small_pool_stack
    reference = [_completion(stack, p, stream=False) for p in (SHORT, LONG)]
    before = stack.worker_stats(LLAMA)["preemptions"]
    started = threading.Event()
    watcher = threading.Thread(target=_set_when_running, args=(stack, started), daemon=True)
    watcher.start()
    with ThreadPoolExecutor(2) as pool:
        # The older request streams when the newer one (the one preempted) does not.
        older = pool.submit(_completion, stack, SHORT, not preempted_streams)
        assert started.wait(30)
        newer = pool.submit(_completion, stack, LONG, preempted_streams)
        results = [older.result(60), newer.result(60)]
    assert stack.worker_stats(LLAMA)["preemptions"] > before, stack.logs()
    assert results == reference
    stack.wait_for_no_blocks()


def _set_when_running(stack: ServingStack, started: threading.Event) -> None:
    """Set ``started`` once the worker runs a request."""
    while True:
        try:
            if stack.worker_stats(LLAMA)["active"] >= 1:
                break
        except OSError:  # a slow answer on a loaded machine: ask again
            pass
        started.wait(0.005)
    started.set()


def _take_every_free_block(client: PoolClient, stream: str, owner: str) -> None:
    # The running request may take a block between the count and the allocation (refused
    # whole, nothing taken): count again. It converges: the request cannot grow once all is held.
    deadline = time.monotonic() + 10
    while True:
        try:
            client.allocate(stream, client.n_free(stream) * client.config.block_size, owner)
            return
        except BlockPoolExhaustedError:
            assert time.monotonic() < deadline, f"the free {stream} blocks kept changing"


@pytest.fixture(scope="module")
def impatient_stack() -> Iterator[ServingStack]:
    stack = ServingStack(
        [LLAMA],
        daemon_args=("--n-blocks", "64", "--lease", "1"),
        # No prompt cache: its entries (the reference run's KV) would be given back when the
        # growth is refused, and the request would complete without giving way. On demand: the
        # reference run ends at max_tokens, after which auto would reserve the request whole,
        # and it would never grow.
        worker_args=[
            "--max-concurrent",
            "2",
            "--queue-timeout",
            "1",
            "--prompt-cache-bytes",
            "0",
            "--reserve",
            "on-demand",
        ],
    ).start()
    yield stack
    stack.stop()


def test_a_request_refused_alone_waits_past_its_queue_timeout_and_completes(
    impatient_stack: ServingStack,
) -> None:
    # Another session takes every free block while the request runs: its next growth is
    # refused with nothing of its worker's to preempt but itself. It could fit alone, so it
    # gives way and waits at the head of the queue, longer than --queue-timeout (it was
    # admitted once), and completes as if nothing happened once the blocks come back.
    stack = impatient_stack
    body = {"prompt": LONG, "max_tokens": 300, "temperature": 0, "return_token_ids": True}
    reference = stack.complete(LLAMA, body).body["choices"][0]["token_ids"]
    started = threading.Event()
    watcher = threading.Thread(target=_set_when_running, args=(stack, started), daemon=True)
    watcher.start()
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(stack.complete, LLAMA, body)
        assert started.wait(30)
        with PoolClient(stack.run_dir, name="hog") as hog:
            for stream in ("k", "v"):
                _take_every_free_block(hog, stream, "hog-request")
            deadline = time.monotonic() + 20
            while stack.worker_stats(LLAMA)["preemptions"] < 1:
                assert not pending.done(), pending.result()
                assert time.monotonic() < deadline, stack.logs()
                time.sleep(0.01)
            time.sleep(1.5)  # past the queue timeout, waiting at the head of the queue
            assert not pending.done()
            hog.free_all("hog-request")
        reply = pending.result(60)
    assert reply.status == 200, reply
    choice = reply.body["choices"][0]
    assert choice["finish_reason"] == "length" and "finish_detail" not in choice, choice
    assert choice["token_ids"] == reference
    stats = stack.worker_stats(LLAMA)
    assert stats["queue_timeouts"] == 0 and stats["exhaustions"] == 0
    stack.wait_for_no_blocks()


def test_growth_goes_ahead_of_a_parked_admission() -> None:
    # A budget leaves llama 32 block ids: one request of 120 + 100 tokens (28 at its end) fits,
    # two do not. The second one's admission parks at the daemon, which serves llama's
    # allocations in order, except growths: the first one's growths go ahead of the parked
    # admission (which waits for the bytes the first one holds: queued behind it, they would
    # deadlock until a timeout), so it runs to its end unpreempted and the second one follows.
    # Both complete with the tokens of a run alone. On demand: after the reference runs (to
    # max_tokens) auto would reserve the first one whole, and it would never grow.
    hog_ids = 16
    stack = ServingStack(
        [LLAMA],
        daemon_args=(
            "--budget",
            f"{(32 + hog_ids) * 4096 + builtin_weights(LLAMA)}B",
            "--lease",
            "1",
        ),
        worker_args=["--max-concurrent", "2", "--queue-timeout", "30", "--reserve", "on-demand"],
    ).start()
    try:
        with PoolClient(stack.run_dir, name="hog", bytes_per_block=4096) as hog:
            for stream in ("k", "v"):
                hog.allocate(stream, hog_ids // 2 * BLOCK, "hog-request")
            prompts = [[1 + (i * 11 + j * 3) % 200 for j in range(120)] for i in range(2)]
            body = {"max_tokens": 100, "temperature": 0, "return_token_ids": True}

            def complete(prompt: list[int]) -> list[int]:
                reply = stack.complete(LLAMA, {**body, "prompt": prompt})
                assert reply.status == 200, reply
                choice = reply.body["choices"][0]
                assert choice["finish_reason"] == "length" and "finish_detail" not in choice
                tokens: list[int] = choice["token_ids"]
                return tokens

            reference = [complete(prompt) for prompt in prompts]
            started = threading.Event()
            watcher = threading.Thread(target=_set_when_running, args=(stack, started))
            watcher.start()
            with ThreadPoolExecutor(2) as pool:
                first = pool.submit(complete, prompts[0])
                assert started.wait(30)
                second = pool.submit(complete, prompts[1])
                results = [first.result(120), second.result(120)]
            assert results == reference
            stats = stack.worker_stats(LLAMA)
            assert stats["exhaustions"] == 0 and stats["queue_timeouts"] == 0
            assert stats["preemptions"] == 0 and stats["waits"] >= 1
            stack.daemon.audit()
        stack.wait_for_no_blocks()
    finally:
        stack.stop()
