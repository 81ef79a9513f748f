"""The batched pooled cache's block bookkeeping, driven directly: rows bring their blocks to a
merge, growth comes from the pool before a step (a row it cannot grow is reported, nothing else
changes), a write past the covered slots is refused, a row that leaves gives its blocks back at
once, cutting shared left padding gives back blocks no longer covering slots, and the buffers
never hold more bytes than the rows' blocks."""

from __future__ import annotations

import copy

import mlx.core as mx
import pytest
from vqpool.shared.allocator import BlockPoolAllocator
from vqpool.shared.pool import PoolConfig
from vqpool.worker.kv.batch_cache import (
    PooledBatch,
    PooledBatchKVCache,
    RowBlocks,
    batch_of,
    make_row_cache,
)
from vqpool.worker.kv.storage import KVLayout

LAYOUT = KVLayout(n_layers=2, n_kv_heads=2, k_head_dim=4, v_head_dim=4, dtype=mx.float32)


def merged(
    pool: BlockPoolAllocator, slots: list[int], prefix: str = "row"
) -> list[PooledBatchKVCache]:
    """A batch of empty rows, row i (owner ``{prefix}-{i}``) holding blocks for ``slots[i]``
    slots."""
    rows = []
    for i, n in enumerate(slots):
        row = RowBlocks(pool, f"{prefix}-{i}", LAYOUT)
        row.reserve(n)
        rows.append(make_row_cache(row))
    return [rows[0][layer].merge([r[layer] for r in rows]) for layer in range(LAYOUT.n_layers)]


def write(cache: list[PooledBatchKVCache], n_tokens: int) -> None:
    """One forward pass writing ``n_tokens`` slots of every row, every layer."""
    batch = batch_of(cache)
    assert batch is not None
    shape = (len(batch.rows), LAYOUT.n_kv_heads, n_tokens, LAYOUT.k_head_dim)
    for layer in cache:
        layer.update_and_fetch(mx.ones(shape), mx.ones(shape))


def assert_covered(batch: PooledBatch) -> None:
    layout = batch.layout
    slot_bytes = layout.n_kv_heads * (layout.k_head_dim + layout.v_head_dim) * layout.dtype.size
    per_row = batch.length * slot_bytes * layout.n_layers
    assert batch.nbytes == per_row * len(batch.rows)
    for row in batch.rows:
        assert row.capacity >= batch.length


def test_rows_cover_the_buffers_and_growth_comes_before_the_step() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=64))
    cache = merged(pool, [20, 40])
    batch = batch_of(cache)
    assert batch is not None
    # Buffers as long as the row with the fewest blocks covers (2 blocks: 32 slots).
    assert batch.length == 32
    assert_covered(batch)
    write(cache, 30)
    with pytest.raises(RuntimeError, match="ensure"):
        write(cache, 5)
    assert cache[0].size() == 30 and cache[1].size() == 30  # nothing written
    assert batch.ensure(35) == []
    assert batch.length >= 35
    assert_covered(batch)
    write(cache, 5)
    assert cache[0].size() == 35
    # A row's tokens come out as a stock copy; the batch itself cannot be copied.
    extracted = cache[0].extract(1)
    assert extracted.offset == 35 and extracted.keys.shape == (1, 2, 35, 4)
    with pytest.raises(TypeError, match="cannot be copied"):
        copy.deepcopy(cache[0])


def test_a_row_the_pool_cannot_grow_is_reported_and_nothing_is_copied() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=12))  # 6 per stream
    cache = merged(pool, [16, 64])  # 1 + 4 blocks per stream
    batch = batch_of(cache)
    assert batch is not None
    assert batch.length == 16
    assert batch.ensure(40) == [0]  # row 0 needs 2 more, 1 is free
    assert batch.length == 16 and batch.rows[0].n_blocks == 1
    # The caller takes the row out; the other one grows (it already covers 64 slots).
    for layer in cache:
        layer.filter([1])
    assert pool.n_blocks_for("row-0") == 0 and batch.rows[0].owner == "row-1"
    assert batch.ensure(40) == []
    assert batch.length == 64
    assert_covered(batch)


def test_leaving_rows_give_blocks_back_at_once_and_cut_padding() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=256))
    cache = merged(pool, [8, 8])
    batch = batch_of(cache)
    assert batch is not None
    # A long newcomer joins: the running rows are grown first, then the batches joined.
    newcomer = merged(pool, [100], prefix="new")
    new_batch = batch_of(newcomer)
    assert new_batch is not None
    write(cache, 5)
    write(newcomer, 90)
    assert batch.ensure(91) == [] and new_batch.ensure(91) == []
    for mine, theirs in zip(cache, newcomer, strict=True):
        mine.extend(theirs)
    assert len(batch.rows) == 3 and new_batch.nbytes == 0
    assert cache[0].size() == 90
    assert cache[0].left_padding.tolist() == [85, 85, 0]
    assert batch.length == 96  # the running rows grew to 6 blocks, the newcomer holds 7
    assert_covered(batch)
    assert pool.n_blocks_for("row-0") == 2 * 6  # its padding is covered by its own blocks
    # The long row leaves: its blocks go back now, the padding the others share is cut off
    # and their blocks beyond what is left (5 slots: 1 block) go back too.
    for layer in cache:
        layer.filter([0, 1])
    assert pool.n_blocks_for("new-0") == 0
    assert cache[0].size() == 5 and cache[0].left_padding.tolist() == [0, 0]
    assert batch.length == 96 - 85  # the joined buffers had 6 spare slots to the right
    assert_covered(batch)
    assert [row.n_blocks for row in batch.rows] == [1, 1]


def test_prompts_prefilled_together_are_right_padded_then_rolled_left() -> None:
    # mlx-lm's PromptProcessingBatch over pooled rows: prompts of different lengths prefilled
    # in one batch use prepare (right padding) and finalize (rolled to left padding); the
    # greedy tokens then equal mlx-lm's batch_generate with stock caches.
    from mlx_lm.generate import PromptProcessingBatch, batch_generate
    from vqpool.worker.models.loading import load_model

    model = load_model("builtin:llama").model
    layout = KVLayout.from_model(model)
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=256))
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9], [1, 4]]
    caches = []
    for i, prompt in enumerate(prompts):
        row = RowBlocks(pool, f"row-{i}", layout)
        row.reserve(len(prompt) + 10)
        caches.append(make_row_cache(row))
    prefill = PromptProcessingBatch(model, uids=[0, 1, 2], caches=caches, tokens=[[], [], []])
    prefill.prompt([p[:-1] for p in prompts])
    batch = batch_of(prefill.prompt_cache)
    assert batch is not None
    assert prefill.prompt_cache[0].left_padding.tolist() == [5, 0, 11]
    generation = prefill.generate([[p[-1]] for p in prompts])
    tokens: list[list[int]] = [[], [], []]
    for _ in range(8):
        n_slots = generation.prompt_cache[0].size() + 1
        assert batch.ensure(n_slots) == []
        assert batch.length >= n_slots
        for response in generation.next():
            tokens[response.uid].append(response.token)

    class NoTokenizer:
        eos_token_ids: tuple[int, ...] = ()

        def decode(self, tokens: list[int]) -> str:
            return ""

    reference = batch_generate(
        model, NoTokenizer(), prompts, max_tokens=8, return_token_ids=True
    ).token_ids
    assert tokens == reference
    assert_covered(batch)
