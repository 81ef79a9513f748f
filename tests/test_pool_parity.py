"""The local allocator and a PoolClient on a live daemon behave the same, call for call."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from daemon_harness import daemon_args_for
from vqpool.shared import (
    AllocationRequest,
    BlockPool,
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    OwnerAlreadyActiveError,
    PoolConfig,
)
from vqpool.shared.protocol import stats_to_wire
from vqpool.worker import PoolClient
from vqpool.worker.testing.launch import DaemonProcess

MakePool = Callable[[PoolConfig], BlockPool]


def block_tuples(blocks: Any) -> list[tuple[Any, ...]]:
    return [(b.block_id, b.stream, b.format, b.n_used, b.owner) for b in blocks]


def as_the_daemon_does(pool: BlockPool, failed: list[tuple[Any, bool]]) -> None:
    """The daemon's deliberate difference (docs/protocol.md): an allocation that fails leaves no
    owner registered that was not active before; the local allocator keeps it (seed). Undo that
    locally, so that both go on from the same state. ``failed``: (owner, was it active)."""
    if isinstance(pool, BlockPoolAllocator):
        for owner, was_active in failed:
            if not was_active and not pool.blocks_for(owner):
                pool.release_owner(owner)


def run_script(pool: BlockPool, seed: int, steps: int = 300) -> list[Any]:
    """A random but seeded sequence of calls; every outcome and the stats after each call."""
    local = pool if isinstance(pool, BlockPoolAllocator) else None
    rng = random.Random(seed)
    owners: list[int | str] = [1, 2, 3, "a", "b", "c"]
    held: dict[int | str, list[Any]] = {}
    outcomes: list[Any] = []
    for _ in range(steps):
        op = rng.choice(
            [
                "allocate",
                "allocate",
                "allocate_many",
                "free",
                "free_all",
                "register_owner",
                "mark_used",
                "n_free",
                "blocks_for",
            ]
        )
        owner = rng.choice(owners)
        stream = rng.choice(["k", "v"])
        try:
            if op == "allocate":
                was_active = local is not None and local.is_active(owner)
                try:
                    blocks = pool.allocate(
                        stream, rng.randrange(1, 90), owner, rng.choice(["fp16", "int4"])
                    )
                except BlockPoolExhaustedError:
                    as_the_daemon_does(pool, [(owner, was_active)])
                    raise
                held.setdefault(owner, []).extend(blocks)
                result: Any = block_tuples(blocks)
            elif op == "allocate_many":
                requests = [
                    AllocationRequest(
                        rng.choice(["k", "v"]), rng.randrange(0, 40), rng.choice(owners)
                    )
                    for _ in range(rng.randrange(1, 5))
                ]
                result = []
                active = {r.owner: local is not None and local.is_active(r.owner) for r in requests}
                items = pool.allocate_many(requests)
                failed = []
                for request, item in zip(requests, items, strict=True):
                    if isinstance(item, Exception):
                        result.append(type(item).__name__)
                        failed.append((request.owner, active[request.owner]))
                    else:
                        held.setdefault(request.owner, []).extend(item)
                        result.append(block_tuples(item))
                as_the_daemon_does(pool, failed)
            elif op == "free":
                mine = held.get(owner, [])
                chosen = rng.sample(mine, k=min(len(mine), rng.randrange(0, 4)))
                pool.free(chosen)
                result = [b.block_id for b in chosen]
            elif op == "free_all":
                pool.free_all(owner)
                result = [b.block_id for b in held.pop(owner, [])]
            elif op == "register_owner":
                pool.register_owner(owner)
                result = None
            elif op == "mark_used":
                mine = held.get(owner, [])
                if mine:
                    block, n_used = rng.choice(mine), rng.randrange(0, 17)
                    pool.mark_used(block, n_used)
                    result = (block.block_id, n_used)
                else:
                    result = None
            elif op == "n_free":
                result = pool.n_free(stream)
            else:
                result = block_tuples(pool.blocks_for(owner))
        except Exception as exc:
            result = type(exc).__name__
        outcomes.append((op, result, stats_to_wire(pool.stats)))
    return outcomes


@pytest.mark.parametrize(
    "config",
    [
        PoolConfig(n_blocks=64),
        PoolConfig(n_blocks=48, separate_kv=False, block_size=8),
        PoolConfig(n_blocks=16, grow_on_exhaustion=True, max_blocks=80),
    ],
    ids=["separate-kv", "shared-kv", "grow"],
)
def test_same_calls_give_the_same_results(
    config: PoolConfig, start_daemon: Callable[..., DaemonProcess]
) -> None:
    local = run_script(BlockPoolAllocator(config), seed=7)
    daemon = start_daemon(*daemon_args_for(config))
    with PoolClient(daemon.run_dir, name="parity") as client:
        remote = run_script(client, seed=7)
    assert remote == local
    daemon.audit()


def test_both_are_block_pools(make_pool: MakePool) -> None:
    pool = make_pool(PoolConfig(n_blocks=32))
    assert isinstance(pool, BlockPool)
    assert pool.config.n_blocks == 32 and pool.config.block_size == 16


def test_exhaustion_allocates_nothing(make_pool: MakePool) -> None:
    pool = make_pool(PoolConfig(n_blocks=8))
    pool.allocate("k", 16 * 3, "a")
    with pytest.raises(BlockPoolExhaustedError):
        pool.allocate("k", 16 * 2, "b")
    assert pool.n_free("k") == 1
    assert pool.stats.n_exhausted == 1
    if isinstance(pool, BlockPoolAllocator):
        with pytest.raises(OwnerAlreadyActiveError):  # the failed owner stays registered (seed)
            pool.register_owner("b")
    else:
        pool.register_owner("b")  # the daemon's difference: a failed allocate registers nothing


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p: p.allocate("k", 0, "x"), "n_tokens must be > 0"),
        (lambda p: p.allocate("q", 4, "x"), "stream must be 'k' or 'v'"),
        (lambda p: p.n_free("q"), "stream must be 'k' or 'v'"),
        (lambda p: p.mark_used(p.allocate("k", 4, "y")[0], 17), "n_used must be in 0..16"),
    ],
)
def test_bad_arguments_raise_value_error(
    make_pool: MakePool, call: Callable[[BlockPool], Any], message: str
) -> None:
    pool = make_pool(PoolConfig(n_blocks=8))
    with pytest.raises(ValueError, match=message):
        call(pool)


def test_free_updates_the_callers_blocks(make_pool: MakePool) -> None:
    pool = make_pool(PoolConfig(n_blocks=16))
    first = pool.allocate("k", 40, "r")
    second = pool.allocate("v", 20, "r")
    pool.mark_used(first[-1], 16)
    assert first[-1].n_used == 16
    pool.free(first[:1])
    assert first[0].owner is None and first[0].n_used == 0
    assert [b.block_id for b in pool.blocks_for("r")] == [
        *(b.block_id for b in first[1:]),
        *(b.block_id for b in second),
    ]
    pool.free_all("r")
    assert all(b.owner is None and b.n_used == 0 for b in [*first, *second])
    assert pool.blocks_for("r") == []
    assert pool.stats.blocks_in_use() == 0
    pool.register_owner("r")  # released


def test_mark_used_many_checks_everything_first(make_pool: MakePool) -> None:
    pool = make_pool(PoolConfig(n_blocks=16))
    blocks = pool.allocate("k", 32, "r")
    with pytest.raises(ValueError):
        pool.mark_used_many([(blocks[0], 3), (blocks[1], 99)])
    assert [b.n_used for b in pool.blocks_for("r")] == [16, 16]
    pool.mark_used_many([(blocks[0], 3), (blocks[1], 5)])
    assert [b.n_used for b in pool.blocks_for("r")] == [3, 5]
    assert pool.stats.fragmentation() == pytest.approx(2 / 16)
