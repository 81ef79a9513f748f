"""The pooled KV cache against mlx-lm's stock KVCache: same tokens, same logprobs, blocks back.

Every test takes the ``pool`` fixture, so the same tests run on any ``BlockPool``: local
allocators (separate K/V streams and one shared "kv" stream) and a ``PoolClient`` on a real
``vqpoold`` process. ``audit(pool)`` recounts the pool's books: in process for a local
allocator, through the daemon's admin ``audit`` for a remote one.
"""

from __future__ import annotations

import copy
import functools
import itertools
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from daemon_harness import daemon_args_for, remove_tree, short_tmpdir
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, make_prompt_cache, trim_prompt_cache
from vqpool.shared import (
    Block,
    BlockPool,
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    OwnerAlreadyActiveError,
    PoolConfig,
)
from vqpool.shared.admin_client import AdminClient
from vqpool.shared.pool import AllocationRequest, AllocationResult
from vqpool.worker import KVLayout, MLXBlockStorage, PoolClient, make_pooled_cache
from vqpool.worker.kv.cache import PooledPromptCache, blocks_to_hold
from vqpool.worker.models.tiny_models import build_tiny_model
from vqpool.worker.testing.launch import DaemonProcess

ARCHS = ["llama", "qwen2", "qwen3"]
PROMPT_LEN = 100
GEN_LEN = 200


# -- fixtures and helpers --------------------------------------------------------------------------


POOL_CONFIG = PoolConfig(block_size=16, n_blocks=512)


@pytest.fixture(scope="module")
def shared_daemon() -> Iterator[DaemonProcess]:
    """One vqpoold for the module's daemon-backed tests (each test uses its own owner ids)."""
    base = short_tmpdir()
    daemon = DaemonProcess(base / "run", *daemon_args_for(POOL_CONFIG)).start()
    yield daemon
    daemon.stop()
    remove_tree(base)


@pytest.fixture(params=["local-separate-kv", "local-shared-kv", "daemon"])
def pool(request: pytest.FixtureRequest) -> Iterator[BlockPool]:
    """A block pool with room for every test here: a local allocator with separate K/V
    streams or one shared stream, or a PoolClient on a live vqpoold."""
    if request.param == "daemon":
        daemon: DaemonProcess = request.getfixturevalue("shared_daemon")
        with PoolClient(daemon.run_dir, name="pooled-cache-test") as client:
            yield client
        daemon.audit()
        assert daemon.admin("stats")["stats"]["blocks_in_use"] == 0, "a test leaked blocks"
        return
    separate_kv = request.param == "local-separate-kv"
    yield BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=512, separate_kv=separate_kv))


@pytest.fixture
def owner() -> str:
    """An owner id no other test (or process sharing a daemon) uses."""
    return f"test-{uuid.uuid4().hex[:12]}"


def audit(pool: BlockPool) -> None:
    """Recount the pool's books: in process, or through the daemon's admin audit."""
    if isinstance(pool, BlockPoolAllocator):
        pool.check_invariants()
    else:
        assert isinstance(pool, PoolClient)
        with AdminClient(pool.run_dir, timeout=5.0) as admin:
            report = admin.call("audit")
        assert report["ok"], report["problems"]


@functools.cache
def tiny(name: str, dtype: mx.Dtype = mx.float32) -> nn.Module:
    return build_tiny_model(name, seed=0, dtype=dtype)[0]


def prompt_ids(n: int, salt: int = 0) -> mx.array:
    return mx.array([(i * 37 + 11 + salt) % 256 for i in range(n)])


def run(
    model: nn.Module,
    prompt: mx.array,
    cache: Sequence[Any],
    n_tokens: int,
    *,
    prefill_step_size: int = 2048,
    after_step: Callable[[], None] | None = None,
) -> tuple[list[int], mx.array]:
    """Greedy-generate ``n_tokens``; return the tokens and the stacked logprobs."""
    tokens: list[int] = []
    logprobs: list[mx.array] = []
    steps = generate_step(
        prompt,
        model,
        max_tokens=n_tokens,
        prompt_cache=cache,
        prefill_step_size=prefill_step_size,
    )
    # generate_step is annotated as yielding arrays, but yields each token as an int.
    for token, lp in steps:
        tokens.append(int(token))
        logprobs.append(lp)
        if after_step is not None:
            after_step()
    return tokens, mx.stack(logprobs)


def assert_same(
    reference: tuple[list[int], mx.array], got: tuple[list[int], mx.array], what: str
) -> None:
    ref_tokens, ref_lp = reference
    got_tokens, got_lp = got
    assert got_tokens == ref_tokens, f"{what}: tokens differ from stock KVCache"
    assert len(set(ref_tokens)) > len(ref_tokens) // 4, f"{what}: tokens barely vary"
    assert mx.array_equal(got_lp, ref_lp).item(), f"{what}: logprobs differ from stock KVCache"


def assert_held(pool: BlockPool, cache: PooledPromptCache, n_tokens: int) -> None:
    """The pool holds the blocks ``n_tokens`` need, plus at most the growth reserve (none below
    256 tokens), the cache knows exactly those, and its storage holds exactly their bytes."""
    blocks = pool.blocks_for(cache.owner)
    block_size = pool.config.block_size
    n_streams = len(pool.config.streams)
    needed = -(-n_tokens // block_size) * n_streams
    assert needed <= len(blocks) <= blocks_to_hold(n_tokens, block_size) * n_streams
    storage = cache.sequence.storage
    assert sorted(b.block_id for b in cache.sequence.blocks()) == sorted(b.block_id for b in blocks)
    assert all(storage.holds(b.block_id) for b in blocks)
    by_block = sum(storage.bytes_per_block(b.stream) for b in blocks)
    assert cache.nbytes == by_block


def assert_released(pool: BlockPool, cache: PooledPromptCache) -> None:
    assert pool.blocks_for(cache.owner) == []
    assert cache.sequence.storage.sequence(cache.owner) is None
    assert cache.nbytes == 0
    audit(pool)


# -- identity with stock mlx-lm --------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_and_logprobs_match_stock(arch: str, pool: BlockPool, owner: str) -> None:
    model = tiny(arch)
    prompt = prompt_ids(PROMPT_LEN)
    reference = run(model, prompt, make_prompt_cache(model), GEN_LEN)
    cache = make_pooled_cache(model, pool, owner)
    got = run(model, prompt, cache, GEN_LEN, after_step=lambda: audit(pool))
    assert_same(reference, got, arch)
    assert cache[0].offset == PROMPT_LEN + GEN_LEN
    assert_held(pool, cache, PROMPT_LEN + GEN_LEN)
    cache.release()
    assert_released(pool, cache)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_matches_stock(arch: str, pool: BlockPool, owner: str) -> None:
    # 23 is not a multiple of the block size: chunks end mid-block and the next chunk starts there.
    model = tiny(arch)
    prompt = prompt_ids(PROMPT_LEN, salt=5)
    reference = run(model, prompt, make_prompt_cache(model), 40, prefill_step_size=23)
    with make_pooled_cache(model, pool, owner) as cache:
        got = run(model, prompt, cache, 40, prefill_step_size=23, after_step=lambda: audit(pool))
        assert_held(pool, cache, PROMPT_LEN + 40)
    assert_same(reference, got, f"{arch} chunked prefill")
    assert_released(pool, cache)


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_matches_stock(arch: str, pool: BlockPool, owner: str) -> None:
    model = tiny(arch, mx.bfloat16)
    prompt = prompt_ids(PROMPT_LEN, salt=9)
    reference = run(model, prompt, make_prompt_cache(model), 60)
    with make_pooled_cache(model, pool, owner) as cache:
        assert cache.sequence.layout.dtype == mx.bfloat16
        got = run(model, prompt, cache, 60, after_step=lambda: audit(pool))
        assert {b.format for b in pool.blocks_for(owner)} == {"bf16"}
        assert_held(pool, cache, PROMPT_LEN + 60)
    assert_same(reference, got, f"{arch} bf16")
    assert_released(pool, cache)


def test_trim_then_continue_matches_stock_and_returns_blocks(pool: BlockPool, owner: str) -> None:
    model = tiny("llama")
    prompt = prompt_ids(PROMPT_LEN, salt=3)
    stock = make_prompt_cache(model)
    pooled = make_pooled_cache(model, pool, owner)
    first_ref = run(model, prompt, stock, 60)
    first_got = run(model, prompt, pooled, 60)
    assert_same(first_ref, first_got, "before trim")
    n_before = len(pool.blocks_for(owner))

    # 37 tokens back crosses two block boundaries (160 -> 123): whole blocks go back to the pool.
    assert trim_prompt_cache(stock, 37) == 37
    assert trim_prompt_cache(pooled, 37) == 37
    n_cached = PROMPT_LEN + 60 - 37
    assert pooled[0].offset == n_cached
    assert_held(pool, pooled, n_cached)
    assert len(pool.blocks_for(owner)) < n_before
    audit(pool)

    resume = mx.array(first_ref[0][20:24])
    assert_same(run(model, resume, stock, 80), run(model, resume, pooled, 80), "after trim")
    assert_held(pool, pooled, n_cached + 4 + 80)
    # Trimming one layer alone gives nothing back: the other layers still use the blocks.
    assert pooled[0].trim(10_000) == n_cached + 4 + 80
    assert_held(pool, pooled, n_cached + 4 + 80)
    pooled.release()
    assert_released(pool, pooled)


def test_pool_n_used_matches_tokens_after_sync(pool: BlockPool, owner: str) -> None:
    model = tiny("qwen2")
    with make_pooled_cache(model, pool, owner) as cache:
        run(model, prompt_ids(PROMPT_LEN), cache, 45)
        cache.sequence.sync_usage()
        n_tokens = cache[0].offset
        block_size = pool.config.block_size
        for blocks in (cache.sequence._k_blocks, cache.sequence._v_blocks):
            by_id = {b.block_id: b for b in pool.blocks_for(owner)}
            used = [by_id[b.block_id].n_used for b in blocks]
            assert used == [
                min(block_size, max(0, n_tokens - i * block_size)) for i in range(len(blocks))
            ]
    assert_released(pool, cache)


def test_two_sequences_interleaved_on_one_pool_and_storage(pool: BlockPool) -> None:
    model = tiny("qwen3")
    storage = MLXBlockStorage(
        KVLayout.from_model(model, block_size=pool.config.block_size),
        separate_kv=pool.config.separate_kv,
    )
    prompts = [prompt_ids(PROMPT_LEN, salt=1), prompt_ids(70, salt=2)]
    references = [run(model, p, make_prompt_cache(model), 120) for p in prompts]
    owners = [f"test-a-{uuid.uuid4().hex[:8]}", f"test-b-{uuid.uuid4().hex[:8]}"]
    caches = [make_pooled_cache(model, pool, o, storage=storage) for o in owners]
    streams = [
        generate_step(p, model, max_tokens=120, prompt_cache=c)
        for p, c in zip(prompts, caches, strict=True)
    ]
    results: list[list[tuple[Any, mx.array]]] = [[], []]
    for _ in range(120):
        for i, steps in enumerate(streams):
            results[i].append(next(steps))
            audit(pool)
            ids_a = {b.block_id for b in pool.blocks_for(owners[0])}
            ids_b = {b.block_id for b in pool.blocks_for(owners[1])}
            assert not ids_a & ids_b
            assert storage.nbytes == storage.expected_nbytes()
    for i, reference in enumerate(references):
        got = ([t for t, _ in results[i]], mx.stack([lp for _, lp in results[i]]))
        assert_same(reference, got, f"sequence {i}")
    assert storage.n_sequences == 2
    caches[0].release()
    assert_released(pool, caches[0])
    assert_held(pool, caches[1], 70 + 120)
    caches[1].release()
    assert_released(pool, caches[1])
    assert storage.nbytes == 0 and storage.n_blocks == 0 and storage.n_sequences == 0


# -- pool traffic ----------------------------------------------------------------------------------


class CountingPool:
    """A BlockPool that forwards to a real one and records which methods were called."""

    def __init__(self, inner: BlockPool) -> None:
        self.inner = inner
        self.calls: list[str] = []

    @property
    def config(self) -> PoolConfig:
        return self.inner.config

    def allocate(
        self, stream: str, n_tokens: int, owner: Any, format: str = "fp16"
    ) -> Sequence[Block]:
        self.calls.append("allocate")
        return self.inner.allocate(stream, n_tokens, owner, format)

    def allocate_many(self, requests: Sequence[AllocationRequest]) -> list[AllocationResult]:
        self.calls.append("allocate_many")
        return self.inner.allocate_many(requests)

    def free(self, blocks: Any) -> None:
        self.calls.append("free")
        self.inner.free(blocks)

    def free_all(self, owner: Any) -> None:
        self.calls.append("free_all")
        self.inner.free_all(owner)

    def register_owner(self, owner: Any) -> None:
        self.calls.append("register_owner")
        self.inner.register_owner(owner)

    def mark_used_many(self, updates: Sequence[tuple[Block, int]]) -> None:
        self.calls.append("mark_used_many")
        self.inner.mark_used_many(updates)


def test_pool_is_called_only_when_a_block_boundary_is_crossed(pool: BlockPool, owner: str) -> None:
    model = tiny("llama")
    counting = CountingPool(pool)
    cache = make_pooled_cache(model, counting, owner)  # type: ignore[arg-type]
    block_size = pool.config.block_size
    capacities: list[int] = []
    calls_per_step: list[int] = []

    def after_step() -> None:
        calls_per_step.append(len(counting.calls))
        counting.calls.clear()
        capacities.append(cache.sequence.capacity)

    run(model, prompt_ids(PROMPT_LEN), cache, 300, after_step=after_step)
    # generate_step builds step n+1 before yielding n, so step n's calls come with step n+1's
    # growth; what matters: a step with calls is a step where the capacity grew, by whole blocks.
    grew = [b > a for a, b in itertools.pairwise(capacities)]
    for i, n_calls in enumerate(calls_per_step[1:]):
        assert n_calls == (2 if grew[i] else 0), f"step {i + 1}: {n_calls} pool calls"
    assert all(c % block_size == 0 for c in capacities)
    # Past 256 tokens the reserve makes growth rarer than one per block.
    assert sum(grew) < (PROMPT_LEN + 300) // block_size - PROMPT_LEN // block_size
    cache.release()
    assert counting.calls == ["free_all"]
    assert_released(pool, cache)


# -- errors leave state unchanged ------------------------------------------------------------------


def test_exhaustion_mid_generation_raises_and_changes_nothing(owner: str) -> None:
    model = tiny("llama")
    small = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=16, separate_kv=True))
    cache = make_pooled_cache(model, small, owner)
    tokens: list[int] = []
    with pytest.raises(BlockPoolExhaustedError):
        for token, _ in generate_step(prompt_ids(PROMPT_LEN), model, prompt_cache=cache):
            tokens.append(int(token))
    small.check_invariants()
    # 8 blocks per stream = 128 slots: the step writing slot 129 failed before any layer wrote.
    assert [c.offset for c in cache] == [128] * len(cache)
    assert_held(small, cache, 128)
    cache.release()
    assert_released(small, cache)
    assert small.n_free("k") == 8 and small.n_free("v") == 8


def test_wrong_layout_is_refused_without_change(pool: BlockPool, owner: str) -> None:
    model = tiny("qwen2")
    with make_pooled_cache(model, pool, owner) as cache:
        run(model, prompt_ids(20), cache, 3)
        n_blocks = len(pool.blocks_for(owner))
        offset = cache[0].offset
        wrong = [
            (mx.zeros((1, 4, 1, 16), mx.float16), mx.zeros((1, 4, 1, 16), mx.float16)),
            (mx.zeros((1, 2, 1, 16)), mx.zeros((1, 2, 1, 16))),
            (mx.zeros((2, 4, 1, 16)), mx.zeros((2, 4, 1, 16))),
            (mx.zeros((1, 4, 1, 16)), mx.zeros((1, 4, 2, 16))),
        ]
        for keys, values in wrong:
            with pytest.raises(ValueError, match="expected keys"):
                cache[0].update_and_fetch(keys, values)
        assert cache[0].offset == offset
        assert len(pool.blocks_for(owner)) == n_blocks
    assert_released(pool, cache)


def test_owner_in_use_is_refused(pool: BlockPool, owner: str) -> None:
    model = tiny("llama")
    storage = MLXBlockStorage(KVLayout.from_model(model), separate_kv=pool.config.separate_kv)
    with make_pooled_cache(model, pool, owner, storage=storage):
        with pytest.raises(OwnerAlreadyActiveError):
            make_pooled_cache(model, pool, owner)
        with pytest.raises(ValueError, match="already open"):
            make_pooled_cache(model, pool, owner, storage=storage)
        assert storage.n_sequences == 1


def test_storage_must_fit_pool_and_model(pool: BlockPool, owner: str) -> None:
    model = tiny("llama")
    layout = KVLayout.from_model(model)
    other_split = MLXBlockStorage(layout, separate_kv=not pool.config.separate_kv)
    with pytest.raises(ValueError, match="separate_kv"):
        make_pooled_cache(model, pool, owner, storage=other_split)
    with pytest.raises(ValueError, match="layers"):
        make_pooled_cache(
            tiny("llama"),
            pool,
            owner,
            storage=MLXBlockStorage(
                KVLayout(3, 2, 16, 16, mx.float32), separate_kv=pool.config.separate_kv
            ),
        )
    audit(pool)
    assert pool.blocks_for(owner) == []


def test_sliding_window_models_are_refused(pool: BlockPool, owner: str) -> None:
    from mlx_lm.models import llama

    args = llama.ModelArgs.from_dict(
        {
            "model_type": "llama",
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "rms_norm_eps": 1e-5,
            "vocab_size": 64,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 8,
        }
    )
    with pytest.raises(ValueError, match="RotatingKVCache"):
        make_pooled_cache(llama.Model(args), pool, owner)
    assert pool.blocks_for(owner) == []


def test_released_cache_refuses_writes(pool: BlockPool, owner: str) -> None:
    model = tiny("llama")
    cache = make_pooled_cache(model, pool, owner)
    run(model, prompt_ids(20), cache, 2)
    cache.release()
    cache.release()  # idempotent
    with pytest.raises(RuntimeError, match="released"):
        run(model, prompt_ids(5), cache, 1)
    assert_released(pool, cache)


# -- state, deepcopy ------------------------------------------------------------------------------


def test_deepcopy_is_a_detached_snapshot(pool: BlockPool, owner: str) -> None:
    model = tiny("qwen3")
    stock = make_prompt_cache(model)
    with make_pooled_cache(model, pool, owner) as cache:
        first = run(model, prompt_ids(PROMPT_LEN), cache, 30)
        run(model, prompt_ids(PROMPT_LEN), stock, 30)
        held = [b.block_id for b in pool.blocks_for(owner)]
        snapshot = copy.deepcopy(cache)
        layer_copy = copy.deepcopy(cache[1])
        assert type(snapshot) is list and all(type(c) is KVCache for c in snapshot)
        assert type(layer_copy) is KVCache and layer_copy.offset == cache[1].offset
        assert [b.block_id for b in pool.blocks_for(owner)] == held
        for pooled, copied, ref in zip(cache, snapshot, stock, strict=True):
            assert copied.offset == pooled.offset == ref.offset
            assert mx.array_equal(copied.state[0][..., : copied.offset, :], pooled.state[0]).item()
            assert mx.array_equal(copied.state[1][..., : copied.offset, :], pooled.state[1]).item()
        resume = mx.array(first[0][-2:])
        expected = run(model, resume, stock, 40)
        assert_same(expected, run(model, resume, snapshot, 40), "snapshot")
        assert_same(expected, run(model, resume, cache, 40), "original after copy")
    assert_released(pool, cache)
    assert snapshot[0].offset == PROMPT_LEN + 30 + 2 + 40  # the snapshot outlives the release


def test_state_round_trip_and_setter(pool: BlockPool, owner: str) -> None:
    model = tiny("qwen2")
    stock = make_prompt_cache(model)
    first = run(model, prompt_ids(PROMPT_LEN), stock, 25)
    with make_pooled_cache(model, pool, owner) as cache:
        assert cache[0].empty() and cache[0].state[0].shape[2] == 0
        for pooled, ref in zip(cache, stock, strict=True):
            pooled.state = ref.state  # stock state: (keys, values, offset), keys padded
            assert pooled.offset == ref.offset
            assert mx.array_equal(pooled.state[0], ref.keys[..., : ref.offset, :]).item()
            assert pooled.meta_state == ""
            assert pooled.is_trimmable() and not pooled.empty()
        assert_held(pool, cache, PROMPT_LEN + 25)
        assert not hasattr(cache[0], "bits")
        resume = mx.array(first[0][-1:])
        assert_same(run(model, resume, stock, 30), run(model, resume, cache, 30), "from state")
        # Setting a shorter state on every layer gives blocks back.
        for pooled in cache:
            keys, values = pooled.state
            pooled.state = (keys[..., :20, :], values[..., :20, :])
        assert_held(pool, cache, 20)
        audit(pool)
    assert_released(pool, cache)
