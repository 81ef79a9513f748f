"""Unit tests of BlockPoolAllocator's behaviour, one seed behaviour at a time."""

from __future__ import annotations

import copy
import json
import pickle
import random
import threading
from collections.abc import Callable

import msgpack
import pytest
from vqpool.shared import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_HISTORY_SIZE,
    AllocationRequest,
    AllocationStats,
    Block,
    BlockPool,
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    ClaimConflictError,
    OwnerAlreadyActiveError,
    PoolConfig,
)
from vqpool.shared.allocator import BlockList
from vqpool.shared.errors import VqpoolError


def pool_of(**kwargs: object) -> BlockPoolAllocator:
    return BlockPoolAllocator(PoolConfig(**kwargs))  # type: ignore[arg-type]


def test_defaults() -> None:
    assert DEFAULT_BLOCK_SIZE == 16
    assert DEFAULT_HISTORY_SIZE == 256
    config = PoolConfig()
    assert (config.block_size, config.n_blocks, config.separate_kv) == (16, 1024, True)
    assert (config.grow_on_exhaustion, config.max_blocks) == (False, None)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 0}, "block_size must be >= 1, got 0"),
        ({"n_blocks": 0}, "n_blocks must be >= 1, got 0"),
        ({"n_blocks": 8, "max_blocks": 4}, "max_blocks (4) must be >= n_blocks (8)"),
    ],
)
def test_config_validation(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        PoolConfig(**kwargs)  # type: ignore[arg-type]
    assert message in str(excinfo.value)


def test_separate_kv_splits_blocks_between_streams() -> None:
    pool = pool_of(n_blocks=9)
    assert pool.streams == ("k", "v")
    assert (pool.n_free("k"), pool.n_free("v")) == (4, 4)
    assert pool.stats.n_blocks == 8  # n_blocks // 2 per stream, as the seed
    shared = pool_of(n_blocks=9, separate_kv=False)
    assert shared.streams == ("kv",)
    assert shared.n_free("k") == shared.n_free("v") == shared.n_free("kv") == 9


def test_stream_errors() -> None:
    pool = pool_of(n_blocks=4)
    with pytest.raises(ValueError, match="stream must be 'k' or 'v', got 'kv'"):
        pool.allocate("kv", 1, owner=1)
    with pytest.raises(ValueError, match="got 'q'"):
        pool.n_free("q")
    assert pool.active_owners() == []  # stream checked before the owner is registered
    # A shared pool treats every stream name as "kv".
    assert pool_of(n_blocks=4, separate_kv=False).allocate("q", 1, 1)[0].stream == "kv"


def test_allocate_blocks_fill_and_order() -> None:
    pool = pool_of(n_blocks=8, block_size=16)
    blocks = pool.allocate("k", 40, owner=7, format="int2")
    assert [b.block_id for b in blocks] == [3, 2, 1]  # top of the free list first, as the seed
    assert [b.n_used for b in blocks] == [16, 16, 8]
    assert {(b.stream, b.format, b.owner, b.ever_allocated) for b in blocks} == {
        ("k", "int2", 7, True)
    }
    assert [b.block_id for b in pool.allocate("v", 1, owner=7)] == [7]
    assert pool.blocks_for(7) == [*blocks, pool.blocks_for(7)[-1]]
    assert pool.stats.n_allocations == 4
    assert pool.stats.fragmentation() == 2 / 8


def test_allocate_rejects_non_positive_tokens_without_change() -> None:
    pool = pool_of(n_blocks=4)
    for n in (0, -3):
        with pytest.raises(ValueError, match=f"n_tokens must be > 0, got {n}"):
            pool.allocate("k", n, owner=1)
    assert pool.active_owners() == []
    assert len(pool.history) == 0


def test_exhaustion_is_all_or_nothing() -> None:
    pool = pool_of(n_blocks=4)
    pool.allocate("k", 16, owner=1)
    with pytest.raises(BlockPoolExhaustedError, match=r"requested 2 block\(s\) .* only 1 free"):
        pool.allocate("k", 17, owner=2)
    assert pool.n_free("k") == 1
    assert pool.blocks_for(2) == []
    assert pool.stats.n_exhausted == 1
    assert pool.stats.blocks_in_use() == 1
    # As in the seed, the failed call left owner 2 registered.
    with pytest.raises(OwnerAlreadyActiveError):
        pool.register_owner(2)


def test_lifo_reuse_counts_reused_blocks() -> None:
    pool = pool_of(n_blocks=8)
    a = pool.allocate("k", 32, owner=1)
    pool.free([a[0]])
    again = pool.allocate("k", 16, owner=2)
    assert again[0].block_id == a[0].block_id
    assert pool.stats.n_reused == 1
    fresh = pool.allocate("k", 16, owner=2)
    assert fresh[0].block_id == 1 and pool.stats.n_reused == 1


def test_register_and_release_owner() -> None:
    pool = pool_of(n_blocks=4)
    pool.register_owner("req-1")
    with pytest.raises(OwnerAlreadyActiveError, match="'req-1' is already active"):
        pool.register_owner("req-1")
    pool.allocate("k", 1, owner="req-1")  # an active owner grows, never collides
    pool.allocate("k", 1, owner="req-1")
    pool.release_owner("req-1")
    assert not pool.is_active("req-1")
    assert pool.n_blocks_for("req-1") == 2  # release_owner frees nothing
    pool.register_owner("req-1")
    pool.free_all("req-1")
    assert pool.owners() == []


def test_free_is_idempotent_and_releases_owner_with_last_block() -> None:
    pool = pool_of(n_blocks=8)
    blocks = pool.allocate("k", 48, owner=1)
    pool.free([blocks[1]])
    pool.free([blocks[1]])  # already free: nothing happens
    assert pool.stats.n_frees == 1
    assert blocks[1].owner is None and blocks[1].n_used == 0
    assert pool.is_active(1)
    pool.free([blocks[2], blocks[0]])
    assert not pool.is_active(1)
    assert pool.n_free("k") == 4


def test_free_by_copy_frees_the_same_block() -> None:
    pool = pool_of(n_blocks=4)
    (block,) = pool.allocate("k", 5, owner=1)
    copy = Block(block_id=block.block_id, owner=1)
    pool.free([copy])
    assert copy.owner is None and pool.owner_of(block.block_id) is None
    assert pool.n_free("k") == 2 and pool.blocks_for(1) == []


def test_handed_out_blocks_stay_in_step() -> None:
    pool = pool_of(n_blocks=16, block_size=4)
    first = pool.allocate("k", 10, owner=1)
    second = pool.allocate("k", 4, owner=1)
    seen_first, seen_second = list(first), list(second)  # built before any change
    pool.mark_used(Block(block_id=first[1].block_id), 1)
    assert seen_first[1].n_used == 1
    pool.free([Block(block_id=first[0].block_id)])
    assert (seen_first[0].owner, seen_first[0].n_used) == (None, 0)
    pool.free_all(1)
    assert all(b.owner is None and b.n_used == 0 for b in seen_first + seen_second)
    third = pool.allocate("v", 4, owner=2)
    pool.free(third)  # a whole allocation, never looked at: read afterwards, it is free
    assert [(b.owner, b.n_used) for b in third] == [(None, 0)]


def test_free_all_after_a_partial_free_returns_each_block_once() -> None:
    pool = pool_of(n_blocks=16)
    blocks = pool.allocate("k", 16 * 8, owner=1)
    pool.free(blocks[2:])
    pool.free_all(1)
    assert pool.n_free("k") == 8 and pool.stats.n_frees == 8
    pool.check_invariants()
    again = pool.allocate("k", 16 * 8, owner=2)
    assert sorted(again.block_ids) == list(range(8))


def test_usage_counts_blocks_and_used_slots_per_stream() -> None:
    pool = pool_of(n_blocks=32, block_size=4)
    k = pool.allocate("k", 10, owner=1)  # 4 + 4 + 2
    pool.allocate("v", 3, owner=1)
    pool.mark_used(k[0], 1)
    pool.free([k[1]])
    assert pool.usage(1) == {"k": (2, 3), "v": (1, 3)}
    assert pool.usage(1)["k"][1] == sum(b.n_used for b in pool.blocks_for(1) if b.stream == "k")
    assert pool.usage(2) == {}


def test_free_all() -> None:
    pool = pool_of(n_blocks=8)
    pool.allocate("k", 40, owner=1)
    pool.allocate("v", 20, owner=1)
    pool.allocate("k", 1, owner=2)
    pool.free_all(1)
    assert pool.blocks_for(1) == [] and not pool.is_active(1)
    assert (pool.n_free("k"), pool.n_free("v")) == (3, 4)
    assert pool.stats.n_frees == 5
    pool.free_all(99)  # unknown owner: no-op, still recorded
    assert pool.stats.n_frees == 5
    assert len(pool.history) == 5


def test_shrink_retires_only_free_blocks() -> None:
    pool = pool_of(n_blocks=8)
    held = pool.allocate("k", 16, owner=1)
    assert pool.shrink("k", target_free=1) == 2
    assert pool.n_free("k") == 1 and pool.n_total("k") == 2
    assert pool.shrink("k", target_free=5) == 0
    assert pool.stats.n_retired == 2 and pool.stats.n_blocks == 6
    assert held[0].owner == 1 and pool.blocks_for(1) == held
    with pytest.raises(ValueError, match="target_free must be >= 0, got -1"):
        pool.shrink("k", -1)
    # Retired ids never come back.
    pool.free_all(1)
    ids = {b.block_id for b in pool.allocate("k", 32, owner=2)}
    assert ids == {0, 3}  # 1 and 2 were retired


def test_shrink_that_retires_nothing_adds_no_history_row() -> None:
    # The seed records history inside "if retired:" (its text lost that indentation).
    pool = pool_of(n_blocks=8)
    pool.allocate("k", 16, owner=1)
    rows = len(pool.history)
    assert pool.shrink("k", target_free=3) == 0  # exactly 3 free: nothing to retire
    assert pool.shrink("v", target_free=10) == 0
    assert len(pool.history) == rows
    assert pool.shrink("k", target_free=1) == 2
    assert len(pool.history) == rows + 1 and pool.history[-1].n_retired == 2
    assert pool.shrink("k", target_free=0) == 1
    assert pool.shrink("k", target_free=0) == 0  # nothing free left: no row either
    assert [h.n_retired for h in pool.history][rows:] == [2, 3]


def test_grow_on_exhaustion_respects_max_blocks() -> None:
    pool = pool_of(n_blocks=4, grow_on_exhaustion=True, max_blocks=7)
    blocks = pool.allocate("k", 16 * 4, owner=1)  # 2 free + 2 grown
    assert [b.block_id for b in blocks] == [5, 4, 1, 0]
    assert pool.stats.n_grown == 2 and pool.stats.n_blocks == 6
    assert pool.stats.n_reused == 0
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("k", 16 * 3, owner=2)  # only 1 more may be grown
    assert pool.stats.n_blocks == 7 and pool.n_free("k") == 1
    unbounded = pool_of(n_blocks=2, grow_on_exhaustion=True)
    unbounded.allocate("v", 16 * 100, owner=1)
    assert unbounded.stats.n_grown == 99


def test_mark_used_keeps_fragmentation_exact() -> None:
    pool = pool_of(n_blocks=4, block_size=4)
    (block,) = pool.allocate("k", 4, owner=1)
    assert pool.stats.fragmentation() == 0.0
    pool.mark_used(block, 2)
    assert block.n_used == 2 and pool.stats.fragmentation() == 0.25
    pool.mark_used(block, 3)
    assert pool.stats.fragmentation() == 0.25
    pool.mark_used(block, 4)
    assert pool.stats.fragmentation() == 0.0
    with pytest.raises(ValueError, match=r"n_used must be in 0..4, got 5"):
        pool.mark_used(block, 5)
    assert block.n_used == 4
    pool.free([block])
    pool.mark_used(block, 1)  # a free block: the object changes, the stats do not
    assert pool.stats._fragmented_count == 0
    with pytest.raises(ValueError):
        pool.mark_used_many([(block, 1), (block, 9)])
    assert block.n_used == 1


def test_allocate_many_reports_per_item() -> None:
    pool = pool_of(n_blocks=4)
    results = pool.allocate_many(
        [
            AllocationRequest("k", 16, 1),
            AllocationRequest("k", 64, 2),
            AllocationRequest("x", 1, 3),
            AllocationRequest("v", 1, 3, "int4"),
        ]
    )
    assert not isinstance(results[0], Exception) and results[0][0].block_id == 1
    assert isinstance(results[1], BlockPoolExhaustedError)
    assert isinstance(results[2], ValueError)
    assert not isinstance(results[3], Exception) and results[3][0].format == "int4"


def test_stats_snapshot_repr_and_prometheus() -> None:
    pool = pool_of(n_blocks=4)
    pool.allocate("k", 17, owner=1)
    snap = pool.stats.snapshot()
    pool.free_all(1)
    assert snap.blocks_in_use() == 2 and pool.stats.blocks_in_use() == 0
    assert repr(snap) == (
        "AllocationStats(in_use=2/4, allocations=2, frees=0, reused=0, exhausted=0, "
        "grown=0, retired=0, peak=2, fragmentation=0.250)"
    )
    assert repr(pool).startswith("BlockPoolAllocator(AllocationStats(in_use=0/4")
    text = snap.to_prometheus()
    assert text.endswith("\n")
    lines = text.splitlines()
    assert lines[:6] == [
        "# TYPE veloxquant_block_pool_blocks_in_use gauge",
        "veloxquant_block_pool_blocks_in_use 2",
        "# TYPE veloxquant_block_pool_blocks_total gauge",
        "veloxquant_block_pool_blocks_total 4",
        "# TYPE veloxquant_block_pool_fragmentation gauge",
        "veloxquant_block_pool_fragmentation 0.250000",
    ]
    names = [line.split()[2] for line in lines if line.startswith("# TYPE")]
    assert names == [
        f"veloxquant_block_pool_{n}"
        for n in (
            "blocks_in_use",
            "blocks_total",
            "fragmentation",
            "peak_blocks_in_use",
            "allocations_total",
            "frees_total",
            "reused_total",
            "exhausted_total",
            "grown_total",
            "retired_total",
        )
    ]
    assert "vq_allocations_total 2" in snap.to_prometheus(prefix="vq")
    assert AllocationStats(n_blocks=0).fragmentation() == 0.0


def test_history_is_bounded_and_one_per_mutating_call() -> None:
    pool = pool_of(n_blocks=4)
    pool.register_owner(1)  # not a recorded call
    pool.allocate("k", 1, owner=1)
    block = pool.blocks_for(1)[0]
    pool.mark_used(block, 3)  # not recorded either
    pool.free([block])
    pool.shrink("k", 0)
    assert [h.n_allocations for h in pool.history] == [1, 1, 1]
    assert [h.n_frees for h in pool.history] == [0, 1, 1]
    assert [h.n_retired for h in pool.history] == [0, 0, 2]
    for _ in range(DEFAULT_HISTORY_SIZE + 10):
        pool.free_all(1)
    assert len(pool.history) == DEFAULT_HISTORY_SIZE
    first = pool.history[0]
    first.n_frees = 999  # readers get copies
    assert pool.history[0].n_frees == 1


def test_local_allocator_is_a_block_pool() -> None:
    assert isinstance(pool_of(), BlockPool)


def test_million_block_pool_is_cheap_and_ends_exact() -> None:
    pool = pool_of(n_blocks=1 << 20)
    blocks = pool.allocate("v", 16 * 3, owner=1)
    assert [b.block_id for b in blocks] == [(1 << 20) - 1, (1 << 20) - 2, (1 << 20) - 3]
    pool.free(reversed(blocks))
    assert pool.n_free("v") == 1 << 19


def test_threads_share_one_pool() -> None:
    pool = pool_of(n_blocks=512, block_size=4)
    errors: list[BaseException] = []

    def worker(worker_id: int) -> None:
        rng = random.Random(worker_id)
        try:
            for step in range(300):
                owner = (worker_id, step % 5)
                try:
                    blocks = pool.allocate(rng.choice("kv"), rng.randint(1, 12), owner)
                except BlockPoolExhaustedError:
                    pool.free_all(owner)
                    continue
                assert all(b.owner == owner for b in blocks)
                if rng.random() < 0.5:
                    pool.free(blocks[:1])
                if rng.random() < 0.3:
                    pool.free_all(owner)
        except BaseException as exc:  # re-raised in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    pool.check_invariants()
    for owner in pool.owners():
        pool.free_all(owner)
    assert pool.stats.blocks_in_use() == 0
    assert pool.n_free("k") + pool.n_free("v") == 512


# -- claim: taking back specific ids after a daemon restart ----------------------------------------


def test_claim_takes_exact_ids_from_the_middle_of_the_never_used_range() -> None:
    pool = pool_of(block_size=4, n_blocks=16)  # k: 0..7, v: 8..15
    blocks = pool.claim("req", "k", [5, 2], fills=[4, 3], format="int4")
    assert [(b.block_id, b.stream, b.n_used, b.owner, b.format) for b in blocks] == [
        (5, "k", 4, "req", "int4"),
        (2, "k", 3, "req", "int4"),
    ]
    assert pool.owner_of(5) == pool.owner_of(2) == "req"
    assert pool.is_active("req")
    assert (pool.n_free("k"), pool.n_total("k"), pool.n_free("v")) == (6, 8, 8)
    assert (pool.stats.blocks_in_use(), pool.stats._fragmented_count) == (2, 1)
    pool.check_invariants()
    # Allocation goes on from the top and steps over the claimed ids.
    got = pool.allocate("k", 6 * 4, "other")
    assert [b.block_id for b in got] == [7, 6, 4, 3, 1, 0]
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("k", 1, "third")
    pool.check_invariants()


def test_claimed_ids_freed_before_allocation_reaches_them_are_free_in_place() -> None:
    pool = pool_of(block_size=4, n_blocks=16)
    pool.claim("req", "k", [5, 2])
    pool.free_all("req")
    assert not pool.is_active("req")
    pool.check_invariants()
    # Same ids in the same order as a pool that never saw the claim.
    fresh = pool_of(block_size=4, n_blocks=16)
    assert [b.block_id for b in pool.allocate("k", 32, "a")] == [
        b.block_id for b in fresh.allocate("k", 32, "a")
    ]


def test_claim_of_recycled_and_grown_ids() -> None:
    pool = pool_of(block_size=4, n_blocks=4, grow_on_exhaustion=True, max_blocks=8)
    first = pool.allocate("k", 8, "a")  # k: 0..1 -> ids 1, 0
    pool.allocate("k", 12, "b")  # grows k by 3: ids 4, 5, 6 (k had 0 free)
    pool.free(first)
    pool.free_all("b")
    blocks = pool.claim("c", "k", [0, 5])
    assert [b.block_id for b in blocks] == [0, 5]
    pool.check_invariants()
    assert pool.n_free("k") == 3
    with pytest.raises(ClaimConflictError, match="held by 'c'"):
        pool.claim("d", "k", [1, 0])
    pool.free([blocks[0]])
    pool.claim("d", "k", [0])
    pool.check_invariants()


def test_claims_beyond_a_growing_pool_grow_it_and_growth_reuses_the_ids_skipped() -> None:
    # A restarted daemon's pool starts at its first id space (k 0..3, v 4..7); the previous one
    # had grown to ids 8..19 in either stream. Claims take them back, in either stream.
    pool = pool_of(block_size=4, n_blocks=8, grow_on_exhaustion=True, max_blocks=24)
    pool.claim("a", "k", [15, 2])
    pool.check_invariants()
    assert (pool.stats.n_blocks, pool.stats.n_grown) == (9, 1)
    assert (pool.n_total("k"), pool.n_free("k")) == (5, 3)
    pool.claim("b", "v", [9, 12])  # skipped by the first claim: ids of either stream
    with pytest.raises(ClaimConflictError, match="held by 'a'"):
        pool.claim("c", "v", [15])
    with pytest.raises(ClaimConflictError, match="may grow to"):
        pool.claim("c", "k", [10, 24])  # past max_blocks: nothing claimed
    assert not pool.is_active("c")
    pool.check_invariants()
    # Growth hands out the ids skipped (8, 10, 11, 13, 14, 16..19) before new ones.
    grown = pool.allocate("k", 4 * 12, "d")
    assert sorted(b.block_id for b in grown) == [0, 1, 3, 8, 10, 11, 13, 14, 16, 17, 18, 19]
    more = pool.allocate("v", 4 * 5, "e")
    assert sorted(b.block_id for b in more) == [4, 5, 6, 7, 20]
    pool.check_invariants()
    # A claimed id freed is an ordinary free id of its stream.
    pool.free_all("b")
    assert pool.claim("f", "v", [12])[0].block_id == 12
    pool.free_all("a")
    pool.check_invariants()
    fixed = pool_of(block_size=4, n_blocks=8)
    with pytest.raises(ClaimConflictError, match="does not grow"):
        fixed.claim("a", "k", [8])


def test_claim_refuses_ids_that_are_not_free_and_changes_nothing() -> None:
    pool = pool_of(block_size=4, n_blocks=16)
    held = pool.allocate("k", 4, "a")[0].block_id
    pool.shrink("v", 6)  # retires v ids 15 and 14
    before = (pool.stats.snapshot(), len(pool.history), pool.n_free("k"), pool.n_free("v"))
    for ids, message in [
        ([3, held], "held by 'a'"),
        ([3, 9], "not a block of stream 'k'"),  # a v block
        ([3, 16], "not a block of stream 'k'"),  # beyond the pool
        ([3, -1], "not a block of stream 'k'"),
    ]:
        with pytest.raises(ClaimConflictError, match=message):
            pool.claim("b", "k", ids)
    with pytest.raises(ClaimConflictError, match="not a block of stream 'v'"):
        pool.claim("b", "v", [15])  # retired
    for ids, fills in [([], None), ([3, 3], None), ([3], [5]), ([3], [-1]), ([3, 2], [1])]:
        with pytest.raises(ValueError):
            pool.claim("b", "k", ids, fills)
    with pytest.raises(ValueError):
        pool.claim("b", "x", [3])
    assert (pool.stats.snapshot(), len(pool.history), pool.n_free("k"), pool.n_free("v")) == before
    assert not pool.is_active("b")
    pool.check_invariants()


def test_claim_adds_to_an_active_owner_and_counts_as_allocation() -> None:
    pool = pool_of(block_size=4, n_blocks=16)
    pool.register_owner("req")
    pool.claim("req", "k", [1])
    pool.claim("req", "v", [9, 10], fills=[4, 0])
    assert [b.block_id for b in pool.blocks_for("req")] == [1, 9, 10]
    assert pool.stats.n_allocations == 3
    assert pool.stats.peak_blocks_in_use == 3
    with pytest.raises(OwnerAlreadyActiveError):
        pool.register_owner("req")
    pool.free_all("req")
    assert pool.stats.blocks_in_use() == 0
    pool.check_invariants()


def test_shrink_after_claims_retires_only_free_blocks() -> None:
    pool = pool_of(block_size=4, n_blocks=16)
    pool.claim("req", "k", [7, 3, 0])
    assert pool.shrink("k", 2) == 3
    pool.check_invariants()
    assert [b.block_id for b in pool.blocks_for("req")] == [7, 3, 0]
    assert (pool.n_free("k"), pool.n_total("k")) == (2, 5)
    pool.free_all("req")
    assert pool.n_free("k") == 5
    pool.check_invariants()


def test_claim_in_a_million_block_pool_moves_nothing() -> None:
    pool = pool_of(n_blocks=1 << 20)
    pool.claim("req", "k", [12345, 400000, 7])
    # O(k): the never-used range is not split or copied onto the recycled stack.
    assert pool._free["k"].recycled == []
    assert pool.n_free("k") == (1 << 19) - 3
    assert pool.allocate("k", 16, "next")[0].block_id == (1 << 19) - 1


def test_many_one_id_claims_of_freed_ids_stay_exact_as_the_pool_changes_between_them() -> None:
    # A daemon restart's claim message: thousands of one-id groups, most ids on the recycled
    # stack. What the pool knows of that stack must follow frees, shrinks and growth between
    # claims: a freed id becomes claimable, a retired one never, a held one stays held.
    pool = pool_of(block_size=4, n_blocks=8192, grow_on_exhaustion=True, max_blocks=8448)
    rng = random.Random(11)
    k_ids = [b.block_id for b in pool.allocate("k", 4096 * 4, "filler")]
    held = pool.allocate("v", 4 * 4, "held")  # v: 4095..4092 stay held
    pool.allocate("v", 4092 * 4, "filler")
    rng.shuffle(k_ids)
    pool.free_ids(k_ids[:3000])  # 3,000 k ids on the stack in random order; 1,096 still held
    still_held = set(k_ids[3000:])
    claimed: dict[int, str] = {}
    for n, block_id in enumerate(k_ids[:2000]):
        owner = f"o{n}"
        assert pool.claim_ids(owner, "k", [block_id]) == (block_id,)
        claimed[block_id] = owner
    for block_id in [*k_ids[:5], *k_ids[3000:3005]]:
        with pytest.raises(ClaimConflictError, match="is held by"):
            pool.claim_ids("late", "k", [block_id])
    with pytest.raises(ClaimConflictError, match="is held by 'held'"):
        pool.claim_ids("late", "v", [held[0].block_id])
    # Freed between claims: claimable at once.
    freed = k_ids[3000:3100]
    pool.free_ids(freed)
    for block_id in freed:
        assert pool.claim_ids(f"f{block_id}", "k", [block_id]) == (block_id,)
    still_held.difference_update(freed)
    # Retired between claims: refused, though it was on the stack when the claims began.
    free_before = pool.n_free("k")
    assert pool.shrink("k", free_before - 10) == 10
    listed_now = set(pool._free["k"].recycled) - pool._free["k"].claimed
    retired = [i for i in k_ids[2000:3000] if i not in listed_now]
    assert len(retired) == 10
    for block_id in retired:
        with pytest.raises(ClaimConflictError, match="not a block of stream 'k'"):
            pool.claim_ids("late", "k", [block_id])
    # Grown between claims: the new ids are claimable.
    pool.free_all("filler")
    pool.allocate("k", 4 * pool.n_free("k"), "all")
    grown = pool.allocate("k", 8, "grow")  # k was full: two new ids
    pool.free(grown)
    for block in grown:
        assert pool.claim_ids("g", "k", [block.block_id]) == (block.block_id,)
    pool.check_invariants()
    for block_id, owner in claimed.items():
        assert pool.owner_of(block_id) == owner
    assert pool.stats.blocks_in_use() == pool.n_total("k") + pool.n_total("v") - pool.n_free(
        "k"
    ) - pool.n_free("v")


# -- BlockList: allocate() returns a list, as the seed ---------------------------------------------


def ids_of(blocks: object) -> list[int]:
    return [b.block_id for b in blocks]  # type: ignore[attr-defined]


def test_allocate_returns_a_real_list() -> None:
    pool = pool_of(n_blocks=8)
    blocks = pool.allocate("k", 40, owner=1)
    assert isinstance(blocks, list) and len(blocks) == 3
    assert blocks == pool.blocks_for(1) and pool.blocks_for(1) == blocks
    assert (blocks != pool.blocks_for(1)) is False
    assert ids_of(reversed(blocks)) == [1, 2, 3]
    assert blocks[0] in blocks and blocks.index(blocks[1]) == 1 and blocks.count(blocks[2]) == 1
    assert ids_of(blocks[:1] + blocks) == [3, 3, 2, 1]  # list's + is the test
    assert ids_of(blocks * 2) == [3, 2, 1] * 2
    assert ids_of(blocks[::-1]) == [1, 2, 3]


@pytest.mark.parametrize("looked_first", [False, True])
def test_block_list_mutations_never_change_what_the_allocation_holds(looked_first: bool) -> None:
    pool = pool_of(n_blocks=16)
    blocks = pool.allocate("k", 16 * 4, owner=1)  # ids 7, 6, 5, 4
    other = pool.allocate("v", 16, owner=2)  # id 15
    if looked_first:
        assert ids_of(blocks) == [7, 6, 5, 4]
    blocks.sort(key=lambda b: b.block_id)
    assert ids_of(blocks) == [4, 5, 6, 7]
    blocks.reverse()
    blocks.append(other[0])
    blocks.extend(other)
    blocks += other
    blocks.insert(0, other[0])
    assert ids_of(blocks) == [15, 7, 6, 5, 4, 15, 15, 15]
    assert blocks.pop(0).block_id == 15 and blocks.pop().block_id == 15
    blocks.remove(other[0])
    del blocks[-1]
    blocks[1:3] = blocks[2:0:-1]
    blocks *= 1
    assert ids_of(blocks) == [7, 5, 6, 4]
    blocks.clear()
    assert blocks == [] and len(blocks) == 0 and not blocks
    # The allocator's record did not move: same blocks, allocation order, all held.
    assert ids_of(pool.blocks_for(1)) == [7, 6, 5, 4]
    assert ids_of(pool.blocks_for(2)) == [15]
    pool.check_invariants()
    pool.free_all(1)
    assert pool.n_free("k") == 8 and pool.blocks_for(2) == other


@pytest.mark.parametrize("looked_first", [False, True])
def test_free_of_a_shortened_list_frees_exactly_what_is_listed(looked_first: bool) -> None:
    pool = pool_of(n_blocks=16)
    blocks = pool.allocate("k", 16 * 3, owner=1)
    if looked_first:
        assert ids_of(blocks) == [7, 6, 5]
    kept = blocks.pop()
    pool.free(blocks)
    assert (pool.owner_of(7), pool.owner_of(6), pool.owner_of(5)) == (None, None, 1)
    assert [(b.owner, b.n_used) for b in blocks] == [(None, 0), (None, 0)]
    assert (kept.owner, kept.n_used) == (1, 16)
    assert pool.is_active(1) and pool.stats.n_frees == 2
    pool.check_invariants()
    pool.free(blocks)  # already free: nothing more
    assert pool.stats.n_frees == 2
    pool.free([kept])
    assert not pool.is_active(1) and pool.n_free("k") == 8
    pool.check_invariants()


def test_list_changed_with_its_own_blocks() -> None:
    pool = pool_of(n_blocks=16)
    blocks = pool.allocate("k", 32, owner=1)
    blocks.append(blocks[0])
    assert ids_of(blocks) == [7, 6, 7]
    again = pool.allocate("k", 32, owner=1)
    again += again
    assert ids_of(again) == [5, 4, 5, 4]
    pool.check_invariants()


def test_free_of_a_list_with_blocks_added_frees_them_too() -> None:
    pool = pool_of(n_blocks=16)
    first = pool.allocate("k", 16, owner=1)
    second = pool.allocate("v", 16 * 2, owner=2)
    first += second[:1]
    pool.free(first)
    assert not pool.is_active(1)
    assert ids_of(pool.blocks_for(2)) == [second[1].block_id]
    assert pool.stats.n_frees == 2
    pool.check_invariants()


def test_sorted_list_stays_in_step_by_block_not_by_position() -> None:
    pool = pool_of(n_blocks=16, block_size=4)
    blocks = pool.allocate("k", 10, owner=1)  # ids 7, 6, 5: n_used 4, 4, 2
    blocks.sort(key=lambda b: b.block_id)
    assert [(b.block_id, b.n_used) for b in blocks] == [(5, 2), (6, 4), (7, 4)]
    pool.mark_used(Block(block_id=7), 1)
    pool.free([Block(block_id=6)])
    assert [(b.block_id, b.owner, b.n_used) for b in blocks] == [(5, 1, 2), (6, None, 0), (7, 1, 1)]
    pool.free_all(1)
    assert [(b.owner, b.n_used) for b in blocks] == [(None, 0)] * 3


def test_block_list_copies_are_plain_lists() -> None:
    pool = pool_of(n_blocks=8)
    blocks = pool.allocate("k", 32, owner=1)
    for duplicate in (blocks.copy(), copy.copy(blocks), blocks[:], list(blocks)):
        assert type(duplicate) is list and duplicate == blocks
        duplicate.pop()
        assert len(blocks) == 2
    deep = copy.deepcopy(blocks)
    assert type(deep) is list and deep == blocks and deep[0] is not blocks[0]
    restored = pickle.loads(pickle.dumps(blocks))
    assert type(restored) is list and restored == blocks
    pool.free(blocks.copy())  # a copy lists the same blocks: it frees them
    assert pool.stats.blocks_in_use() == 0


FIRST_READS = {
    "len": len,
    "bool": bool,
    "repr": repr,
    "str": str,
    "eq": lambda b: b == [],
    "radd": lambda b: [] + b,  # noqa: RUF005  # list's + is the test
    "rmul": lambda b: 2 * b,
    "tuple": tuple,
    "unpack": lambda b: [*b],
    "reversed": lambda b: list(reversed(b)),
    "sorted": lambda b: sorted(b, key=lambda x: -x.block_id),
    "contains": lambda b: Block(3, "k", "fp16", 16, 1, True) in b,
    "index": lambda b: b.index(Block(1, "k", "fp16", 8, 1, True)),
    "slice": lambda b: b[1:],
    "copy": copy.copy,
    "pickle": lambda b: pickle.loads(pickle.dumps(b)),
}


@pytest.mark.parametrize("read", FIRST_READS.values(), ids=FIRST_READS.keys())
def test_first_read_of_a_block_list_sees_its_blocks(read: Callable[[list[Block]], object]) -> None:
    pool = pool_of(n_blocks=8)
    blocks = pool.allocate("k", 40, owner=1)
    first = read(blocks)  # the first thing done with the list
    assert first == read(list(blocks))
    assert ids_of(blocks) == [3, 2, 1]


# C code reads a list's storage directly (PyList_GET_SIZE, PySequence_Fast): it must find every
# block there right after allocate() or claim(), with no Python-level list method called first.
C_READS: dict[str, tuple[Callable[[list[Block]], object], object]] = {
    "msgpack": (
        lambda b: msgpack.unpackb(msgpack.packb(b, default=lambda x: x.block_id)),
        [3, 2, 1],
    ),
    "json": (lambda b: json.loads(json.dumps(b, default=lambda x: x.block_id)), [3, 2, 1]),
    "list.__len__": (list.__len__, 3),
    "list.__getitem__": (lambda b: list.__getitem__(b, -1).block_id, 1),
    "list.copy": (lambda b: ids_of(list.copy(b)), [3, 2, 1]),
    "list.__iter__": (lambda b: ids_of(list.__iter__(b)), [3, 2, 1]),
    "tuple": (lambda b: ids_of(tuple(b)), [3, 2, 1]),
}


@pytest.mark.parametrize(("read", "want"), C_READS.values(), ids=C_READS.keys())
@pytest.mark.parametrize("how", ["allocate", "claim"])
def test_c_readers_see_every_block_right_away(
    read: Callable[[list[Block]], object], want: object, how: str
) -> None:
    pool = pool_of(n_blocks=8)
    blocks = pool.allocate("k", 40, owner=1) if how == "allocate" else pool.claim(1, "k", [3, 2, 1])
    assert read(blocks) == want


# -- one Block object per id, as the seed keeps them -------------------------------------------


def test_a_block_id_has_one_block_object_for_the_pools_life() -> None:
    pool = pool_of(n_blocks=8, block_size=4)
    first = pool.allocate("k", 6, owner=1, format="int4")  # ids 3, 2
    held = first[0]
    pool.free(first)
    assert (held.owner, held.n_used, held.format) == (None, 0, "int4")
    second = pool.allocate("k", 3, owner=2)  # id 2 again (LIFO), then 3
    again = pool.allocate("k", 4, owner=3)
    assert second[0] is first[1] and again[0] is held  # reused, as the seed's objects are
    assert (held.owner, held.n_used, held.format) == (3, 4, "fp16")  # shows its next owner
    assert (second[0].owner, second[0].n_used) == (2, 3)
    pool.free_all(2)
    assert (first[1].owner, first[1].n_used) == (None, 0) and held.owner == 3
    pool.check_invariants()


def test_a_pools_block_is_changed_by_the_allocator_only() -> None:
    # Its owner, format and fill are read from the allocation that handed it out: allocate and
    # free set none of them, and a caller's write cannot make them disagree with the pool.
    pool = pool_of(n_blocks=8, block_size=4)
    (block,) = pool.allocate("k", 3, owner=1, format="int4")
    for field, value in (("owner", 2), ("format", "fp16"), ("n_used", 4)):
        with pytest.raises(AttributeError):
            setattr(block, field, value)
    assert (block.owner, block.format, block.n_used) == (1, "int4", 3)
    assert block == Block(block.block_id, "k", "int4", 3, 1, True)
    record = copy.copy(block)
    assert type(record) is Block and record == block
    pool.free([block])
    assert record.owner == 1 and (block.owner, block.n_used, block.format) == (None, 0, "int4")
    pool.mark_used(block, 2)  # a free block: only the object changes, as the seed's
    block.n_used = 1  # so does a write, while it is free
    assert block.n_used == 1 and pool.stats._fragmented_count == 0
    assert pool.allocate("k", 4, owner=3)[0] is block and block.n_used == 4  # handed out again
    pool.check_invariants()


def test_free_all_leaves_alone_a_block_freed_before_and_handed_out_again() -> None:
    pool = pool_of(n_blocks=8)
    first = pool.allocate("k", 16 * 2, owner=1)  # ids 3, 2
    pool.free(first[:1])  # id 3 back on the stack
    other = pool.allocate("k", 16, owner=2)  # id 3 again: the same Block object
    assert other[0] is first[0]
    pool.free_all(1)  # frees id 2 only: id 3's Block still shows owner 2
    assert (other[0].owner, other[0].n_used) == (2, 16)
    assert (first[1].owner, first[1].n_used) == (None, 0)
    pool.check_invariants()


def test_ids_path_leaves_block_objects_alone() -> None:
    pool = pool_of(n_blocks=8)
    (block,) = pool.allocate("k", 16, owner=1)
    pool.free([block])
    (block_id,) = pool.allocate_ids("k", 16, owner=2)
    assert block_id == block.block_id and (block.owner, block.n_used) == (None, 0)
    assert pool.allocate("k", 16, owner=3)[0] is not block  # another id: another object
    pool.free_ids([block_id])
    assert pool.allocate("k", 16, owner=4)[0] is block


def test_every_block_of_an_allocation_is_found_by_id() -> None:
    # allocate() maps only an allocation's first id at once, the rest on the first lookup.
    pool = pool_of(n_blocks=64, block_size=4)
    blocks = pool.allocate("k", 4 * 5, owner=1)
    last = blocks[-1].block_id
    assert pool.owner_of(last) == 1 and pool.stream_format_of(last) == ("k", "fp16")
    pool.mark_used(Block(block_id=blocks[2].block_id), 1)
    assert blocks[2].n_used == 1 and pool.usage(1) == {"k": (5, 17)}
    ids = pool.allocate_ids("k", 4 * 3, owner=2)
    pool.free_ids(ids[1:])  # part of an allocation, by id
    assert [pool.owner_of(i) for i in ids] == [2, None, None]
    pool.free([Block(block_id=last)])
    assert ids_of(pool.blocks_for(1)) == ids_of(blocks[:-1])
    pool.check_invariants()


def test_allocate_ids_each_matches_one_call_per_item() -> None:
    """A batch folds its logged counts once, after it (not at each free list's mark it passes):
    its ids, errors, counters and history rows are those of one allocate_ids() per item, across
    batches longer than the history, marks passed, both streams, items of several blocks and
    refused items in between, and frees before the counters are read."""
    rng = random.Random(11)
    single, batched = (BlockPoolAllocator(PoolConfig(n_blocks=2048)) for _ in range(2))
    held: list[tuple[int, ...]] = []
    for round_no in range(60):
        # Rounds of one stream, then of the other, then of both: the free lists' recycled ids
        # together exceed the peak in use, which batches of one-block items then raise.
        streams = (("k",), ("v",), ("k", "v"))[round_no % 3]
        items = [
            (
                rng.choice(streams),
                rng.choice((5, 16) * 30 + (40, 0)),  # rarely several blocks, or refused
                rng.randrange(300),
                "fp16",
            )
            for _ in range(rng.choice((1, 64, 300, 700)))
        ]
        want: list[object] = []
        for stream, n_tokens, owner, fmt in items:
            try:
                want.append(single.allocate_ids(stream, n_tokens, owner, fmt))
            except (ValueError, VqpoolError) as exc:
                want.append(type(exc))
        got: list[object] = []
        batched.allocate_ids_each(items, got, set())  # type: ignore[arg-type]
        assert [r if type(r) is tuple else type(r) for r in got] == want
        held += [r for r in got if type(r) is tuple]
        rng.shuffle(held)
        while len(held) > (200 if round_no % 5 else 0):  # frees: the marks move
            ids = held.pop()
            single.free_ids(ids)
            batched.free_ids(ids)
        if round_no % 3 == 2:  # (a read folds the log: not every round)
            assert batched.stats == single.stats
            assert list(batched.history) == list(single.history)
    assert batched.stats == single.stats
    assert list(batched.history) == list(single.history)
    batched.check_invariants()


def test_a_batch_raising_the_peak_keeps_it_through_frees_before_any_read() -> None:
    # Recycled ids of both streams beyond the peak (each stream's own peak came alone): a
    # batch of one-block items from them raises the peak past DEFAULT_HISTORY_SIZE items, and
    # more frees than the history holds follow before the counters are read.
    single, batched = (BlockPoolAllocator(PoolConfig(n_blocks=2048)) for _ in range(2))
    for pool in (single, batched):
        for stream in ("k", "v"):
            ids = [pool.allocate_ids(stream, 16, owner) for owner in range(200)]
            for one in ids:
                pool.free_ids(one)
    items = [("k" if i % 2 else "v", 16, i, "fp16") for i in range(300)]
    got: list[object] = []
    batched.allocate_ids_each(items, got, set())  # type: ignore[arg-type]
    want = [single.allocate_ids(*item) for item in items]
    assert got == want
    for ids in want:
        single.free_ids(ids)
        batched.free_ids(ids)  # type: ignore[arg-type]
    assert single.stats.peak_blocks_in_use == 300
    assert batched.stats == single.stats
    assert list(batched.history) == list(single.history)


def test_whole_allocations_freed_leave_nothing_behind() -> None:
    pool = pool_of(n_blocks=64)
    for _ in range(100):
        pool.allocate("k", 16 * 8, owner=1)
        pool.allocate_ids("v", 16 * 8, owner=1)
        pool.free_all(1)
        pool.free(pool.allocate("k", 16 * 4, owner=2))
        pool.free_ids(pool.allocate_ids("k", 16 * 4, owner=2))
    assert not pool._unindexed  # nothing kept for allocations that are gone
    pool.check_invariants()


def test_logged_counts_fold_into_the_same_counters_and_history() -> None:
    """The one-block paths log their counts and fold them when read (or the log is long, or
    the peak may rise): a pool read only at the end agrees with one read after every call,
    across more calls than the log holds, rises of the peak, mark_used, both streams, and the
    general paths in between."""
    rng = random.Random(7)
    watched, unread = (BlockPoolAllocator(PoolConfig(n_blocks=512)) for _ in range(2))
    held: list[tuple[BlockList, BlockList]] = []  # each allocation, in both pools
    longest = 0
    for step in range(40_000):
        roll = rng.random()
        stream = "k" if rng.random() < 0.7 else "v"
        n_tokens = rng.choice((5, 16))
        if roll < 0.45 and len(held) < 200 + step // 100 % 50:  # one block, full or partial
            held.append(
                (watched.allocate(stream, n_tokens, step), unread.allocate(stream, n_tokens, step))
            )
        elif roll < 0.9 and held:
            ours, theirs = held.pop(rng.randrange(len(held)) if step % 3 else -1)
            watched.free(ours)
            unread.free(theirs)
        elif roll < 0.95 and held:
            for pool, blocks in zip((watched, unread), held[-1], strict=True):
                pool.mark_used(blocks[0], n_tokens)
        if step % 7919 == 0:  # the general path (it folds): several blocks, then free_all
            for pool in (watched, unread):
                pool.allocate(stream, 40, "many")
                pool.free_all("many")
        assert watched.stats.n_allocations >= 0  # a read folds its log every step
        longest = max(longest, len(unread._events))
    assert longest > DEFAULT_HISTORY_SIZE  # folds that summed codes besides the rows they kept
    assert unread.stats == watched.stats
    assert list(unread.history) == list(watched.history)
    unread.check_invariants()
    watched.check_invariants()
