#!/usr/bin/env python3
"""Benchmark of BlockPoolAllocator operations across pool sizes (1K to 1M blocks), beside the seed.

Prints, per pool size, the median of several runs of each operation (each run the fastest of
ten slices of it, see ``per_call_us``). The seed allocator (``seed_pool.py``, the seed's own
code made runnable) runs in the same process, in rounds alternating with ours (seed, ours, seed,
ours...) on pools of the same size, so that the noise of a shared machine hits both: each seed
figure is printed beside ours with the ratio of the medians and the spread (lowest to highest)
of the per-round ratios. No figure is compared with a number from another run.

    scripts/bench_pool.py            # full run, about a minute (the seed's slow paths included)
    scripts/bench_pool.py --runs 5   # median of 5 rounds
    scripts/bench_pool.py --quick    # a smoke run of every measurement (used by the test suite)
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import seed_pool
from vqpool.shared import BlockPoolAllocator, PoolConfig

SEED_POOL_SIZE = 1 << 14
"""Pool size of the side-by-side rounds (the seed's costs do not grow with the pool, FACTS.md,
but building its pools does: 1M blocks take it about a second)."""

Pool = Any  # a BlockPoolAllocator or the seed's: the same public calls
MakePool = Callable[[int], Pool]


def ours(pool_size: int) -> Pool:
    return BlockPoolAllocator(PoolConfig(n_blocks=pool_size))


def seed(pool_size: int) -> Pool:
    return seed_pool.BlockPoolAllocator(seed_pool.PoolConfig(n_blocks=pool_size))


def median_of(runs: int, measure: Callable[[], float]) -> float:
    return statistics.median(measure() for _ in range(runs))


def side_by_side(
    runs: int, measure: Callable[[MakePool], float]
) -> tuple[float, float, list[float]]:
    """Seed and ours measured in alternating rounds: their medians and the per-round ratios
    (seed / ours: how many times faster ours is)."""
    seed_runs, our_runs = [], []
    for _ in range(runs):
        seed_runs.append(measure(seed))
        our_runs.append(measure(ours))
    ratios = sorted(s / o for s, o in zip(seed_runs, our_runs, strict=True))
    return statistics.median(seed_runs), statistics.median(our_runs), ratios


SLICES = 10
"""A timed run is cut into this many slices; the fastest counts (see per_call_us)."""


def per_call_us(
    make: MakePool, pool_size: int, loops: int, body: Callable[[Pool, int], None]
) -> float:
    """Microseconds per loop iteration of ``body`` on a fresh pool (GC off while timing): the
    fastest of ``SLICES`` slices of ``loops / SLICES`` iterations. On a shared machine the other
    processes only ever add time, and a slice is short enough to fall between them: the fastest
    is the closest to the code's own cost (as ``timeit`` advises), for the seed and ours alike."""
    pool = make(pool_size)
    body(pool, 10)  # warm up
    n = max(1, loops // SLICES)
    gc.disable()
    try:
        fastest = float("inf")
        for _ in range(SLICES if loops >= SLICES else 1):
            start = time.perf_counter()
            body(pool, n)
            fastest = min(fastest, time.perf_counter() - start)
        return fastest / n * 1e6
    finally:
        gc.enable()


def alloc_free_one(pool: Pool, loops: int) -> None:
    allocate, free = pool.allocate, pool.free
    for _ in range(loops):
        free(allocate("k", 1, 1))


def alloc_free_all(n_blocks: int) -> Callable[[Pool, int], None]:
    n_tokens = n_blocks * 16

    def body(pool: Pool, loops: int) -> None:
        allocate, free_all = pool.allocate, pool.free_all
        for _ in range(loops):
            allocate("k", n_tokens, 1)
            free_all(1)

    return body


def alloc_read_free(pool: Pool, loops: int) -> None:
    """The seed's usage: allocate, read every Block of the list, free the list."""
    allocate, free = pool.allocate, pool.free
    for _ in range(loops):
        blocks = allocate("k", 16 * 16, 1)
        for block in blocks:
            block.block_id  # noqa: B018  # the read is what is measured
        free(blocks)


def mark_used_loop(pool: Pool, loops: int) -> None:
    block = pool.allocate("k", 16, 1)[0]
    mark_used = pool.mark_used
    for i in range(loops):
        mark_used(block, i & 15)
    pool.free_all(1)


def in_order(items: list[Any], order: str) -> list[Any]:
    if order == "reverse order":
        items.reverse()
    elif order == "random order":
        random.Random(0).shuffle(items)
    return items


def free_in_order_ms(make: MakePool, pool_size: int, n_blocks: int, order: str) -> float:
    pool = make(pool_size)
    blocks = in_order(list(pool.allocate("k", n_blocks * 16, 1)), order)
    start = time.perf_counter()
    pool.free(blocks)
    return (time.perf_counter() - start) * 1e3


def dict_pop_in_order_ms(n_keys: int, order: str) -> float:
    """Baseline: dict.pop of n keys in the same order. Random order over a large dict misses the
    CPU caches, so its cost per key grows with n though each pop is O(1): the same happens to
    free(), and this shows how much of its growth is memory, not algorithm."""
    table = {key: object() for key in range(n_keys)}
    keys = in_order(list(table), order)
    start = time.perf_counter()
    for key in keys:
        table.pop(key)
    return (time.perf_counter() - start) * 1e3


def build_ms(make: MakePool, pool_size: int) -> float:
    """Milliseconds to build a pool."""
    gc.collect()
    start = time.perf_counter()
    pool = make(pool_size)
    elapsed_ms = (time.perf_counter() - start) * 1e3
    del pool
    return elapsed_ms


def build_mib(make: MakePool, pool_size: int) -> float:
    """MiB of traced Python allocations (peak) to build a pool."""
    gc.collect()
    tracemalloc.start()
    pool = make(pool_size)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del pool
    return peak / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny loop counts: a smoke run")
    parser.add_argument("--runs", type=int, default=7, help="rounds per figure (median reported)")
    args = parser.parse_args()
    runs = 1 if args.quick else args.runs
    scale = 0.01 if args.quick else 1.0
    sizes = [1 << 10, 1 << 14, 1 << 18, 1 << 20]

    def loops(n: int) -> int:
        return max(1, int(n * scale))

    print(
        f"median of {runs} round(s) per figure; the seed runs in the same rounds, alternating "
        f"with ours, on {SEED_POOL_SIZE:,}-block pools\n"
        "x faster: the seed's median / ours, then the lowest and highest per-round ratio\n"
    )
    print(
        f"{'operation':<36}"
        + "".join(f"{s:>11,}" for s in sizes)
        + f"{'ours':>9}{'seed':>9}{'x faster':>9}  spread"
    )

    def row(
        name: str, unit: str, body: Callable[[Pool, int], None], n_loops: int, min_size: int = 0
    ) -> None:
        values = [
            median_of(runs, lambda s=s: per_call_us(ours, s, n_loops, body))
            if s >= min_size
            else None
            for s in sizes
        ]
        seed_us, our_us, ratios = side_by_side(
            runs, lambda make: per_call_us(make, SEED_POOL_SIZE, n_loops, body)
        )
        cells = "".join(f"{'-':>11}" if v is None else f"{v:>11.2f}" for v in values)
        print(
            f"{name + ' (' + unit + ')':<36}{cells}{our_us:>9.2f}{seed_us:>9.2f}"
            f"{seed_us / our_us:>9.2f}  {ratios[0]:.2f}-{ratios[-1]:.2f}"
        )

    row("allocate(1 block)+free", "us", alloc_free_one, loops(50_000))
    for n in (16, 256, 4096):
        row(f"allocate+free_all {n} blocks", "us", alloc_free_all(n), loops(200_000 // n), 2 * n)
    row("allocate(16)+read each Block+free", "us", alloc_read_free, loops(10_000))
    row("mark_used", "us", mark_used_loop, loops(50_000))
    print()
    print("free() of n blocks, by order (ms); linear means the 16,384 figure is ~16x the 1,024 one")
    print("(baseline: dict.pop of as many int keys in the same order, same run, for cache effects)")
    for order in ("allocation order", "reverse order", "random order"):
        small = median_of(runs, lambda o=order: free_in_order_ms(ours, 1 << 20, 1024, o))
        large = median_of(runs, lambda o=order: free_in_order_ms(ours, 1 << 20, 16384, o))
        seed_ms, our_ms, ratios = side_by_side(
            runs, lambda make, o=order: free_in_order_ms(make, SEED_POOL_SIZE * 2, 16384, o)
        )
        base_small = median_of(runs, lambda o=order: dict_pop_in_order_ms(1024, o))
        base_large = median_of(runs, lambda o=order: dict_pop_in_order_ms(16384, o))
        print(
            f"  {order:<18} 1,024: {small:7.3f}   16,384: {large:8.3f}   ratio {large / small:5.1f}"
            f"   baseline ratio {base_large / base_small:5.1f}"
            f"   side by side, 16,384: {our_ms:7.3f} vs seed {seed_ms:8.1f}"
            f" ({seed_ms / our_ms:,.0f}x faster, {ratios[0]:,.0f}-{ratios[-1]:,.0f})"
        )
    print()
    print("pool construction (ms, MiB traced); the seed beside ours at 1,048,576 blocks")
    for s in sizes:
        if s == 1 << 20:
            seed_ms, ms, ratios = side_by_side(runs, lambda make, s=s: build_ms(make, s))
            extra = (
                f"   seed: {seed_ms:7.1f} ms ({seed_ms / ms:,.0f}x), {build_mib(seed, s):6.1f} MiB"
            )
        else:
            ms, extra = median_of(runs, lambda s=s: build_ms(ours, s)), ""
        print(f"  {s:>9,} blocks: {ms:8.3f} ms  {build_mib(ours, s):8.3f} MiB{extra}")


if __name__ == "__main__":
    main()
