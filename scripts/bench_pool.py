#!/usr/bin/env python3
"""Benchmark of BlockPoolAllocator operations across pool sizes (1K to 1M blocks).

Prints, per pool size, the median of several runs of each operation, next to the seed figures
measured on this machine kind (../shared/FACTS.md) and their ratio. The seed itself is not run:
it is a specification, not part of the project.

    scripts/bench_pool.py            # full run, about a minute
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

from vqpool.shared import BlockPoolAllocator, PoolConfig

# Seed figures from FACTS.md (same machine kind): microseconds, or as named.
SEED_ALLOC_FREE_1_US = 3.9
SEED_ALLOC_FREE_ALL_256_US = 134.0
SEED_FREE_16K_MS = {"allocation order": 26.0, "random order": 1070.0, "reverse order": 2500.0}
SEED_BUILD_1M = (1100.0, 210.0)  # ms, MiB


def median_of(runs: int, measure: Callable[[], float]) -> float:
    return statistics.median(measure() for _ in range(runs))


def per_call_us(
    pool_size: int, loops: int, body: Callable[[BlockPoolAllocator, int], None]
) -> float:
    """Microseconds per loop iteration of ``body`` on a fresh pool (GC off while timing)."""
    pool = BlockPoolAllocator(PoolConfig(n_blocks=pool_size))
    body(pool, 10)  # warm up
    gc.disable()
    try:
        start = time.perf_counter()
        body(pool, loops)
        return (time.perf_counter() - start) / loops * 1e6
    finally:
        gc.enable()


def alloc_free_one(pool: BlockPoolAllocator, loops: int) -> None:
    allocate, free = pool.allocate, pool.free
    for _ in range(loops):
        free(allocate("k", 1, 1))


def alloc_free_all(n_blocks: int) -> Callable[[BlockPoolAllocator, int], None]:
    n_tokens = n_blocks * 16

    def body(pool: BlockPoolAllocator, loops: int) -> None:
        allocate, free_all = pool.allocate, pool.free_all
        for _ in range(loops):
            allocate("k", n_tokens, 1)
            free_all(1)

    return body


def alloc_read_free(pool: BlockPoolAllocator, loops: int) -> None:
    """The seed's usage: allocate, read every Block of the list, free the list."""
    allocate, free = pool.allocate, pool.free
    for _ in range(loops):
        blocks = allocate("k", 16 * 16, 1)
        for block in blocks:
            block.block_id  # noqa: B018  # the read is what is measured
        free(blocks)


def mark_used_loop(pool: BlockPoolAllocator, loops: int) -> None:
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


def free_in_order_ms(pool_size: int, n_blocks: int, order: str) -> float:
    pool = BlockPoolAllocator(PoolConfig(n_blocks=pool_size))
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


def build_cost(pool_size: int) -> tuple[float, float]:
    """Milliseconds and MiB (traced Python allocations) to build a pool."""
    gc.collect()
    tracemalloc.start()
    start = time.perf_counter()
    pool = BlockPoolAllocator(PoolConfig(n_blocks=pool_size))
    elapsed_ms = (time.perf_counter() - start) * 1e3
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del pool
    return elapsed_ms, peak / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny loop counts: a smoke run")
    parser.add_argument("--runs", type=int, default=7, help="runs per figure (median reported)")
    args = parser.parse_args()
    runs = 1 if args.quick else args.runs
    scale = 0.01 if args.quick else 1.0
    sizes = [1 << 10, 1 << 14, 1 << 18, 1 << 20]

    def loops(n: int) -> int:
        return max(1, int(n * scale))

    print(f"median of {runs} run(s) per figure; seed figures from FACTS.md\n")
    print(
        f"{'operation':<40}" + "".join(f"{s:>12,}" for s in sizes) + f"{'seed':>10}{'x faster':>10}"
    )

    def row(name: str, unit: str, values: list[float | None], seed: float | None) -> None:
        cells = "".join(f"{'-':>12}" if v is None else f"{v:>12.2f}" for v in values)
        tail = ""
        if seed is not None and values[-1] is not None:
            tail = f"{seed:>10.1f}{seed / values[-1]:>10.1f}"
        print(f"{name + ' (' + unit + ')':<40}{cells}{tail}")

    row(
        "allocate(1 block)+free",
        "us",
        [median_of(runs, lambda s=s: per_call_us(s, loops(50_000), alloc_free_one)) for s in sizes],
        SEED_ALLOC_FREE_1_US,
    )
    for n in (16, 256, 4096):
        values = [
            median_of(runs, lambda s=s, n=n: per_call_us(s, loops(200_000 // n), alloc_free_all(n)))
            if n <= s // 2
            else None
            for s in sizes
        ]
        row(
            f"allocate+free_all {n} blocks",
            "us",
            values,
            SEED_ALLOC_FREE_ALL_256_US if n == 256 else None,
        )
    row(
        "allocate(16)+read each Block+free",
        "us",
        [
            median_of(runs, lambda s=s: per_call_us(s, loops(10_000), alloc_read_free))
            for s in sizes
        ],
        None,
    )
    row(
        "mark_used",
        "us",
        [median_of(runs, lambda s=s: per_call_us(s, loops(50_000), mark_used_loop)) for s in sizes],
        None,
    )
    print()
    print("free() of n blocks, by order (ms); linear means the 16,384 figure is ~16x the 1,024 one")
    print("(baseline: dict.pop of as many int keys in the same order, same run, for cache effects)")
    for order in ("allocation order", "reverse order", "random order"):
        small = median_of(runs, lambda o=order: free_in_order_ms(1 << 20, 1024, o))
        large = median_of(runs, lambda o=order: free_in_order_ms(1 << 20, 16384, o))
        base_small = median_of(runs, lambda o=order: dict_pop_in_order_ms(1024, o))
        base_large = median_of(runs, lambda o=order: dict_pop_in_order_ms(16384, o))
        seed = SEED_FREE_16K_MS[order]
        print(
            f"  {order:<18} 1,024: {small:7.3f}   16,384: {large:8.3f}   ratio {large / small:5.1f}"
            f"   baseline ratio {base_large / base_small:5.1f}"
            f"   seed 16,384: {seed:7.1f}  ({seed / large:,.0f}x faster)"
        )
    print()
    print("pool construction (ms, MiB traced)")
    for s in sizes:
        ms = median_of(runs, lambda s=s: build_cost(s)[0])
        mib = build_cost(s)[1]
        extra = ""
        if s == 1 << 20:
            extra = f"   seed: {SEED_BUILD_1M[0]:.0f} ms, {SEED_BUILD_1M[1]:.0f} MiB"
        print(f"  {s:>9,} blocks: {ms:8.3f} ms  {mib:8.3f} MiB{extra}")


if __name__ == "__main__":
    main()
