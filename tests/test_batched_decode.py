"""Batched decode on pooled blocks, through a live vqpoold: the scheduler's greedy tokens equal
mlx-lm's own batched generation with stock caches (``batch_generate``) and, one request at a
time, ``generate_step``; requests joining mid-batch (chunked prefill) and leaving early keep
their tokens; the batch buffers never hold more bytes than the blocks the rows hold, after every
step; a row the pool cannot grow leaves the batch cleanly (preempted, or ended when alone); no
block is left afterwards."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import batch_generate, generate_step
from mlx_lm.models.cache import KVCache, make_prompt_cache
from vqpool.worker.kv.batch_cache import PooledRowCache
from vqpool.worker.kv.cache_source import CacheSource, PooledCacheSource, StockCacheSource
from vqpool.worker.models.loading import load_model
from vqpool.worker.pool.client import PoolClient
from vqpool.worker.run_worker import open_pool
from vqpool.worker.sched.scheduler import GenerationJob, JobEnd, Scheduler
from vqpool.worker.testing.launch import DaemonProcess

MODEL = load_model("builtin:llama").model
# Different lengths, so rows are left-padded; one prompt of a single token.
PROMPTS = [[1 + (i * 7 + j * 3) % 200 for j in range(n)] for i, n in enumerate([5, 23, 40, 1, 17])]
MAX_TOKENS = [30, 12, 25, 20, 8]


class NoTokenizer:
    """What ``batch_generate`` asks of a tokenizer: no EOS (every request runs to max_tokens)."""

    eos_token_ids: tuple[int, ...] = ()

    def decode(self, tokens: list[int]) -> str:
        return ""


def single_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    """Today's single-request path: ``generate_step`` with a stock cache."""
    steps = generate_step(
        mx.array(prompt), MODEL, max_tokens=max_tokens, prompt_cache=make_prompt_cache(MODEL)
    )
    return [int(token) for token, _ in steps]


REFERENCE = batch_generate(
    MODEL, NoTokenizer(), PROMPTS, max_tokens=MAX_TOKENS, return_token_ids=True
).token_ids


class RecordingSource(PooledCacheSource):
    """A pooled source that records (block ids held, buffer bytes) at each of the scheduler's
    memory samples: after admission and after every step."""

    def __init__(self, model: Any, pool: PoolClient) -> None:
        super().__init__(model, pool)
        self.samples: list[tuple[int, int]] = []

    def nbytes(self) -> int:
        n_bytes = super().nbytes()
        self.samples.append((self.n_blocks(), n_bytes))
        return n_bytes

    def bytes_held(self, n_block_ids: int) -> int:
        """Bytes ``n_block_ids`` block ids (K and V counted apart) stand for."""
        per_index = self.layout.k_block_bytes + self.layout.v_block_bytes
        ids_per_index = 2 if self.pool.config.separate_kv else 1
        return n_block_ids // ids_per_index * per_index


@pytest.fixture
def pooled(
    start_daemon: Callable[..., DaemonProcess],
) -> Iterator[Callable[..., tuple[RecordingSource, DaemonProcess]]]:
    pools: list[PoolClient] = []

    def make(n_blocks: int = 1024) -> tuple[RecordingSource, DaemonProcess]:
        daemon = start_daemon("--n-blocks", str(n_blocks))
        pool, _ = open_pool(str(daemon.run_dir), "batched", MODEL, 5.0)
        pools.append(pool)
        return RecordingSource(MODEL, pool), daemon

    yield make
    for pool in pools:
        pool.close()


def run_jobs(
    source: CacheSource,
    prompts: Sequence[list[int]],
    max_tokens: Sequence[int],
    *,
    max_concurrent: int,
    prefill_step_size: int = 2048,
    reserve: str = "full",
    submit_after: Sequence[int] | None = None,
    scheduler_class: type[Scheduler] = Scheduler,
) -> list[tuple[list[int], JobEnd]]:
    """Run the jobs on a scheduler; job i is submitted once job 0 has sent ``submit_after[i]``
    tokens (all at once without). Returns each job's tokens and end."""
    scheduler = scheduler_class(
        MODEL,
        source,
        owner_prefix="batched",
        eos_token_ids=frozenset(),
        max_concurrent=max_concurrent,
        max_queue=16,
        queue_timeout=60.0,
        prefill_step_size=prefill_step_size,
        reserve=reserve,
    )
    jobs = [GenerationJob(p, m) for p, m in zip(prompts, max_tokens, strict=True)]
    results: list[tuple[list[int], JobEnd] | None] = [None] * len(jobs)
    scheduler.start()
    try:
        after = list(submit_after) if submit_after is not None else [0] * len(jobs)
        scheduler.submit(jobs[0])
        first: list[int] = []
        pending = sorted(range(1, len(jobs)), key=lambda i: after[i])
        while pending and after[pending[0]] <= len(first):
            scheduler.submit(jobs[pending.pop(0)])
        while True:
            event = jobs[0].events.get(timeout=60)
            if isinstance(event, JobEnd):
                results[0] = (first, event)
                break
            assert isinstance(event, int)
            first.append(event)
            while pending and after[pending[0]] <= len(first):
                scheduler.submit(jobs[pending.pop(0)])
        for i in pending:
            scheduler.submit(jobs[i])
        for i, job in enumerate(jobs[1:], start=1):
            tokens: list[int] = []
            while not isinstance(event := job.events.get(timeout=60), JobEnd):
                assert isinstance(event, int)
                tokens.append(event)
            results[i] = (tokens, event)
    finally:
        scheduler.stop()
    assert all(r is not None for r in results)
    return [r for r in results if r is not None]


def assert_no_blocks_left(source: RecordingSource, daemon: DaemonProcess) -> None:
    assert source.n_blocks() == 0 and source.nbytes() == 0
    report = daemon.audit()
    assert report["blocks_in_use"] == 0, report


def assert_bytes_within_blocks(source: RecordingSource) -> None:
    assert source.samples
    for n_block_ids, n_bytes in source.samples:
        assert n_bytes <= source.bytes_held(n_block_ids), (n_block_ids, n_bytes)


def test_mlx_batch_generate_equals_generate_step_here() -> None:
    # The two references agree on this model, so the tests below may use either.
    assert [single_tokens(p, m) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)] == REFERENCE


def test_batched_pooled_tokens_equal_mlx_batch_generate(pooled: Any) -> None:
    source, daemon = pooled()
    results = run_jobs(source, PROMPTS, MAX_TOKENS, max_concurrent=len(PROMPTS))
    assert [tokens for tokens, _ in results] == REFERENCE
    assert all(end.finish_reason == "length" for _, end in results)
    assert_bytes_within_blocks(source)
    # The batch really held several padded rows at once.
    assert max(n_bytes for _, n_bytes in source.samples) > source.bytes_held(2 * 4)
    assert_no_blocks_left(source, daemon)


def test_batch_of_one_equals_generate_step(pooled: Any) -> None:
    source, daemon = pooled()
    results = run_jobs(source, PROMPTS, MAX_TOKENS, max_concurrent=1)
    assert [tokens for tokens, _ in results] == REFERENCE
    assert_bytes_within_blocks(source)
    assert_no_blocks_left(source, daemon)


def test_requests_joining_mid_batch_and_leaving_early_keep_their_tokens(pooled: Any) -> None:
    source, daemon = pooled()
    # Job 0 decodes alone for 3 tokens, then the others join one after another, prefilled in
    # chunks of 4 tokens between its steps; they end at different steps.
    results = run_jobs(
        source,
        PROMPTS,
        MAX_TOKENS,
        max_concurrent=3,
        prefill_step_size=4,
        submit_after=[0, 3, 6, 9, 12],
    )
    assert [tokens for tokens, _ in results] == REFERENCE
    assert_bytes_within_blocks(source)
    assert_no_blocks_left(source, daemon)


def test_no_pool_batches_with_stock_caches() -> None:
    results = run_jobs(
        StockCacheSource(MODEL), PROMPTS, MAX_TOKENS, max_concurrent=3, prefill_step_size=4
    )
    assert [tokens for tokens, _ in results] == REFERENCE


def test_a_row_the_pool_cannot_grow_even_alone_leaves_the_batch_cleanly(pooled: Any) -> None:
    # 16 blocks per stream: 256 slots for two rows that each ask for 400 tokens, reserving
    # their prompts only. The newer row gives way to the older one (preempted), which runs
    # out alone and ends; the newer one then resumes and runs out alone too.
    source, daemon = pooled(n_blocks=32)
    prompts = [PROMPTS[0], PROMPTS[2]]
    results = run_jobs(source, prompts, [400, 400], max_concurrent=2, reserve="prompt")
    ran_out = [end for _, end in results if end.detail and "ran out of blocks" in end.detail]
    assert len(ran_out) == 2 and all(end.finish_reason == "length" for _, end in results)
    for (tokens, _), prompt in zip(results, prompts, strict=True):
        assert 0 < len(tokens) < 400
        assert tokens == single_tokens(prompt, len(tokens))
    assert_bytes_within_blocks(source)
    assert_no_blocks_left(source, daemon)


def test_a_newcomer_the_running_rows_cannot_pad_for_gives_way(pooled: Any) -> None:
    # 10 blocks per stream. A short request (5 + 40 tokens: 3 blocks) runs; a long one
    # (100 + 5: 7 blocks) is admitted beside it, but joining would pad the short row to 101
    # slots (7 blocks) and the pool has none left: the newcomer, the most recently admitted,
    # is preempted instead of the running request; it resumes when that one has ended, and
    # both complete with their own tokens.
    source, daemon = pooled(n_blocks=20)
    long_prompt = [1 + (j * 5) % 200 for j in range(100)]
    results = run_jobs(
        source, [PROMPTS[0], long_prompt], [40, 5], max_concurrent=2, submit_after=[0, 3]
    )
    (short_tokens, short_end), (long_tokens, long_end) = results
    assert short_end.finish_reason == "length" and short_end.detail is None
    assert short_tokens == single_tokens(PROMPTS[0], 40)
    assert long_end.finish_reason == "length" and long_end.detail is None
    assert long_tokens == single_tokens(long_prompt, 5)
    assert_bytes_within_blocks(source)
    assert_no_blocks_left(source, daemon)


def prefix_kv(prompt: list[int], n: int) -> list[KVCache]:
    """Stock per-layer caches holding the KV of ``prompt[:n]``."""
    cache = make_prompt_cache(MODEL)
    MODEL(mx.array([prompt[:n]]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


@pytest.mark.parametrize("pooled_source", [True, False], ids=["pooled", "no-pool"])
def test_a_cache_handed_with_a_cached_prefix_prefills_only_the_rest(
    pooled: Any, pooled_source: bool
) -> None:
    # The seam a prompt cache uses: the job's own cache arrives holding the KV of a prefix
    # of its prompt; only the rest is prefilled, and the tokens are those of the whole prompt.
    cached = 10

    class PrefixScheduler(Scheduler):
        def _open_cache(self, owner: str) -> list[Any]:
            cache = super()._open_cache(owner)
            job_prompt = PROMPTS[int(owner.rsplit("-", 1)[1]) - 1]
            if len(job_prompt) <= cached:
                return cache
            for layer, stock in zip(cache, prefix_kv(job_prompt, cached), strict=True):
                if isinstance(layer, PooledRowCache):
                    layer.keys, layer.values = (
                        stock.keys[..., :cached, :],
                        stock.values[..., :cached, :],
                    )
                else:
                    layer.state = stock.state
            return cache

    source: CacheSource = pooled()[0] if pooled_source else StockCacheSource(MODEL)
    results = run_jobs(
        source, PROMPTS, MAX_TOKENS, max_concurrent=3, scheduler_class=PrefixScheduler
    )
    assert [tokens for tokens, _ in results] == REFERENCE
