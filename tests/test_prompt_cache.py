"""The prompt cache in-process: a real tiny MLX model, the real scheduler and the local allocator
(the live-daemon side is tests/test_serving_prompt_cache.py).

Identity is checked bit for bit: greedy tokens and their log-probabilities with the cache are
exactly those of a run without it, for a retried request, the next turn of a chat (whose prefix
holds generated tokens) and concurrent requests sharing a prefix.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx
import pytest
from vqpool.shared import BlockPoolAllocator, PoolConfig
from vqpool.shared.errors import BlockPoolExhaustedError
from vqpool.worker.kv.cache import PooledSequence, make_pooled_cache
from vqpool.worker.kv.cache_source import PooledCacheSource
from vqpool.worker.kv.disk_writer import DiskWriter
from vqpool.worker.kv.prompt_cache import PromptCache
from vqpool.worker.kv.quantized import KVQuantization
from vqpool.worker.models.loading import LoadedModel, load_model
from vqpool.worker.sched.scheduler import GenerationJob, JobEnd, Scheduler, ScoredToken

BS = 16


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("builtin:llama")


@dataclass
class Worker:
    """A scheduler over a local pool, with or without a prompt cache."""

    scheduler: Scheduler
    pool: BlockPoolAllocator
    source: PooledCacheSource
    cache: PromptCache | None

    def run(self, prompt: list[int], n: int = 12) -> tuple[list[ScoredToken], int, JobEnd]:
        job = GenerationJob(prompt, max_tokens=n, logprobs=True)
        self.scheduler.submit(job)
        tokens: list[ScoredToken] = []
        while True:
            event = job.events.get(timeout=60)
            if isinstance(event, JobEnd):
                return tokens, job.cached_tokens, event
            assert isinstance(event, ScoredToken)
            tokens.append(event)


def start_worker(
    loaded: LoadedModel,
    cache_bytes: int,
    n_blocks: int = 4096,
    max_concurrent: int = 4,
    disk: DiskWriter | None = None,
    quantization: KVQuantization | None = None,
) -> Worker:
    """A worker; ``disk``: its prompt cache's disk tier (tests/test_disk_cache.py);
    ``quantization``: its KV quantized (``--kv-bits``)."""
    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=n_blocks))
    source = PooledCacheSource(loaded.model, pool, quantization=quantization)
    cache = None
    if cache_bytes:
        cache = source.attach_prompt_cache(owner_prefix="w", max_bytes=cache_bytes, disk=disk)
    scheduler = Scheduler(
        loaded.model,
        source,
        owner_prefix="w",
        eos_token_ids=frozenset(),
        max_concurrent=max_concurrent,
        max_queue=16,
        queue_timeout=30.0,
        prompt_cache=cache,
    )
    scheduler.start()
    return Worker(scheduler, pool, source, cache)


@pytest.fixture
def workers(loaded: LoadedModel) -> Iterator[tuple[Worker, Worker]]:
    cached, plain = start_worker(loaded, 1 << 30), start_worker(loaded, 0)
    yield cached, plain
    cached.scheduler.stop()
    plain.scheduler.stop()


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def scored(tokens: list[ScoredToken]) -> list[tuple[int, float]]:
    return [(t.token, t.logprob) for t in tokens]


def cache_owners(pool: BlockPoolAllocator) -> list[str]:
    return sorted(str(o) for o in pool.active_owners() if "-cache-" in str(o))


def test_retry_and_next_turn_reuse_the_cache_and_match_a_run_without_it(
    workers: tuple[Worker, Worker], loaded: LoadedModel
) -> None:
    cached, plain = workers
    rng = random.Random(7)
    turn1 = random_tokens(rng, 300, loaded.vocab_size)
    first, reused, _ = cached.run(turn1)
    assert reused == 0
    baseline, _, _ = plain.run(turn1)
    assert scored(first) == scored(baseline)

    retried, reused, _ = cached.run(turn1)
    assert reused == len(turn1) - 1  # at least one token is prefilled
    assert scored(retried) == scored(baseline)

    # The next turn: the previous prompt, its answer (whose KV was made by decode steps), more.
    turn2 = turn1 + [t.token for t in first] + random_tokens(rng, 37, loaded.vocab_size)
    second, reused, _ = cached.run(turn2)
    assert reused == len(turn1) + len(first)
    assert scored(second) == scored(plain.run(turn2)[0])

    assert cached.cache is not None
    counters = cached.cache.snapshot()
    assert (counters["lookups"], counters["hits"]) == (3, 2)
    assert counters["tokens_reused"] == 299 + 312
    assert counters["tokens_prefilled"] == 300 + 1 + (len(turn2) - 312)
    # One chat keeps one entry: each turn's entry supersedes the ones that are its prefix.
    assert counters["entries"] == 1 and len(cache_owners(cached.pool)) == 1


def test_concurrent_requests_compute_a_shared_prefix_once(
    workers: tuple[Worker, Worker], loaded: LoadedModel
) -> None:
    cached, plain = workers
    rng = random.Random(11)
    system = random_tokens(rng, 200, loaded.vocab_size)
    prompts = [system + random_tokens(rng, 20, loaded.vocab_size) for _ in range(3)]
    jobs = [GenerationJob(p, max_tokens=8, logprobs=True) for p in prompts]
    for job in jobs:  # all admitted at once: max_concurrent is 4
        cached.scheduler.submit(job)
    results: list[list[tuple[int, float]]] = []
    for job in jobs:
        got: list[tuple[int, float]] = []
        while not isinstance(event := job.events.get(timeout=60), JobEnd):
            assert isinstance(event, ScoredToken)
            got.append((event.token, event.logprob))
        results.append(got)
    # The first computes the system prompt; its prompt is stored when the second begins its
    # prefill (it shares the system prompt), and the third finds it stored.
    assert [job.cached_tokens for job in jobs] == [0, 200, 200]
    for prompt, got in zip(prompts, results, strict=True):
        assert got == scored(plain.run(prompt, 8)[0])


def test_a_lone_request_stores_its_kv_when_it_ends_not_before_its_first_token(
    workers: tuple[Worker, Worker], loaded: LoadedModel
) -> None:
    cached, _ = workers
    assert cached.cache is not None
    rng = random.Random(13)
    job = GenerationJob(random_tokens(rng, 200, loaded.vocab_size), max_tokens=300)
    cached.scheduler.submit(job)
    first = job.events.get(timeout=60)
    assert isinstance(first, int)
    # Nobody shares its prompt: storing it would have delayed the first token for nothing.
    assert cached.cache.snapshot()["stores"] == 0
    while not isinstance(job.events.get(timeout=60), JobEnd):
        pass
    snap = cached.cache.snapshot()
    assert (snap["stores"], snap["entries"]) == (1, 1)


def test_cached_bytes_are_the_cache_blocks_times_bytes_per_block(
    workers: tuple[Worker, Worker], loaded: LoadedModel
) -> None:
    cached, _ = workers
    rng = random.Random(3)
    for n in (40, 100, 260):
        cached.run(random_tokens(rng, n, loaded.vocab_size), 5)
    assert cached.cache is not None
    snap = cached.cache.snapshot()
    owners = cache_owners(cached.pool)
    held = sum(len(cached.pool.blocks_for(owner)) for owner in owners)
    assert cached.cache is not None
    layout = cached.cache.storage.layout
    assert snap["entries"] == len(owners) == 3
    assert snap["blocks"] == held == 2 * (-(-45 // BS) - (-105 // BS) - (-265 // BS))
    assert snap["bytes"] == held // 2 * (layout.k_block_bytes + layout.v_block_bytes)
    # No request runs: the storage holds the cache alone, exactly its blocks' bytes.
    storage = cached.cache.storage
    assert storage.nbytes == storage.expected_nbytes() == snap["bytes"]


def kv_layers(cache: PromptCache, n: int, seed: int) -> list[tuple[mx.array, mx.array]]:
    """Random (keys, values) of ``n`` tokens for every layer of the cache's layout."""
    layout = cache.storage.layout
    mx.random.seed(seed)
    return [
        (
            mx.random.normal((1, layout.n_kv_heads, n, layout.k_head_dim)).astype(layout.dtype),
            mx.random.normal((1, layout.n_kv_heads, n, layout.v_head_dim)).astype(layout.dtype),
        )
        for _ in range(layout.n_layers)
    ]


def bare_cache(loaded: LoadedModel, max_bytes: int, n_blocks: int = 256) -> PromptCache:
    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=n_blocks))
    source = PooledCacheSource(loaded.model, pool)
    cache = source.attach_prompt_cache(owner_prefix="c", max_bytes=max_bytes)
    # Sequences made on the cache's storage (the tests' readers) take cached memory first too.
    cache.storage.reclaim = cache.release_bytes
    return cache


def entry_bytes(cache: PromptCache, n_blocks: int) -> int:
    layout = cache.storage.layout
    return n_blocks * (layout.k_block_bytes + layout.v_block_bytes)


def test_the_cap_evicts_the_least_recently_used_entry(loaded: LoadedModel) -> None:
    probe = bare_cache(loaded, 1)
    cache = bare_cache(loaded, 2 * entry_bytes(probe, 2))  # room for two 2-block entries
    a, b, c = ([i] * 32 for i in (1, 2, 3))
    assert cache.store(a, kv_layers(cache, 32, 1)) and cache.store(b, kv_layers(cache, 32, 2))
    target = make_pooled_cache(loaded.model, cache.pool, "reader", storage=cache.storage)
    target.sequence.reserve(64)
    assert cache.reuse([*a, 9], target) == 32  # a is now the most recently used
    target.release()
    assert cache.store(c, kv_layers(cache, 32, 3))
    assert cache_owners(cache.pool) == ["c-cache-1", "c-cache-3"]  # b went
    snap = cache.snapshot()
    assert snap["evictions"] == 1 and snap["bytes"] == 2 * entry_bytes(cache, 2)
    # An entry over the cap is not kept, and a cap of 0 keeps nothing.
    assert not cache.store([5] * 80, kv_layers(cache, 80, 5))
    assert cache.snapshot()["stores_skipped"] == 1 and cache.snapshot()["entries"] == 2
    assert not bare_cache(loaded, 0).store(a, kv_layers(cache, 32, 1))


def test_reuse_copies_exactly_the_cached_keys_and_values(loaded: LoadedModel) -> None:
    cache = bare_cache(loaded, 1 << 30)
    layers = kv_layers(cache, 40, 4)
    tokens = list(range(40))
    cache.store(tokens, layers)  # 2 whole blocks kept
    target = make_pooled_cache(loaded.model, cache.pool, "reader", storage=cache.storage)
    target.sequence.reserve(48)
    assert cache.reuse(tokens[:33], target) == 32
    for layer, (keys, values) in zip(target, layers, strict=True):
        got_keys, got_values = layer.state
        assert layer.offset == 32
        assert mx.array_equal(got_keys, keys[..., :32, :]).item()
        assert mx.array_equal(got_values, values[..., :32, :]).item()
    # A prompt of one block reuses nothing: at least one token must be prefilled.
    other = make_pooled_cache(loaded.model, cache.pool, "short", storage=cache.storage)
    assert cache.reuse(tokens[:16], other) == 0
    # A prompt differing inside the first block misses.
    assert cache.reuse([99, *tokens[1:40]], other) == 0


def test_a_refused_allocation_takes_cached_memory_first_least_recently_used_first(
    loaded: LoadedModel,
) -> None:
    cache = bare_cache(loaded, 1 << 30, n_blocks=2 * 12)  # 12 blocks per stream
    for i in range(4):  # 4 entries of 3 blocks: the pool is full
        assert cache.store([i] * 48, kv_layers(cache, 48, i))
    assert cache.pool.n_free("k") == 0
    reader = make_pooled_cache(loaded.model, cache.pool, "reader", storage=cache.storage)
    reader.sequence.reserve(64)  # 4 blocks: the two oldest entries go, not more
    assert cache_owners(cache.pool) == ["c-cache-3", "c-cache-4"]
    assert cache.snapshot()["evictions"] == 2
    reader.release()
    # What the cache cannot cover is still refused, with the cache emptied first.
    big = PooledSequence(cache.pool, "big", cache.storage)
    with pytest.raises(BlockPoolExhaustedError):
        big.reserve(16 * 13)
    assert cache.snapshot()["entries"] == 0 and big.n_blocks == 0
    big.release()
    assert cache.pool.n_free("k") == 12


def test_a_request_starts_at_once_when_only_the_cache_holds_the_pool(
    loaded: LoadedModel,
) -> None:
    worker = start_worker(loaded, 1 << 30, n_blocks=2 * 40)
    try:
        rng = random.Random(5)
        for _ in range(2):
            worker.run(random_tokens(rng, 300, loaded.vocab_size), 20)
        assert worker.cache is not None
        before = worker.cache.snapshot()
        # 608 slots need 38 blocks and 2 of reserve: more than is free while the cache holds any.
        assert before["entries"] >= 1 and worker.pool.n_free("k") < 38
        _, _, end = worker.run(random_tokens(rng, 600, loaded.vocab_size), 8)
        assert end.finish_reason == "length" and end.detail is None
        stats = worker.scheduler.stats.snapshot()
        assert stats["waits"] == 0  # it never waited: the cache gave its blocks back first
        assert stats["prompt_cache"]["evictions"] > before["evictions"]
    finally:
        worker.scheduler.stop()


def test_release_bytes_and_lost_entries(loaded: LoadedModel) -> None:
    lost: dict[str, str] = {}
    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=256))
    source = PooledCacheSource(loaded.model, pool)
    cache = source.attach_prompt_cache(
        owner_prefix="c", max_bytes=1 << 30, lost_owners=lambda: lost
    )
    for i in range(3):
        cache.store([i] * 32, kv_layers(cache, 32, i))
    one = entry_bytes(cache, 2)
    assert cache.release_bytes(one + 1) == 2 * one  # whole entries, oldest first
    assert cache_owners(pool) == ["c-cache-3"]
    # An entry whose owner the pool lost (restart conflict, eviction): a clean miss.
    lost["c-cache-3"] = "lost in a test"
    target = make_pooled_cache(loaded.model, pool, "reader", storage=cache.storage)
    target.sequence.reserve(48)
    assert cache.reuse([2] * 33, target) == 0
    assert cache.snapshot()["entries"] == 0 and target[0].offset == 0
    assert cache.release_bytes(one) == 0
