#!/usr/bin/env python3
"""Benchmark of one large claim after a daemon restart: the allocator work the daemon does for
one ``claim`` message of 4,096 owners x 16 one-id groups, most ids freed (on the recycled
stack), as :meth:`Coordinator.claim` calls it (``claim_ids`` per group, in one loop turn).

    scripts/bench_claim.py            # 131,072-block pool: every k id freed, then claimed
    scripts/bench_claim.py --quick    # a smaller pool, a smoke run
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from vqpool.shared import BlockPoolAllocator, PoolConfig


def claim_message_seconds(n_blocks: int, owners: int, groups: int, seed: int) -> float:
    """Seconds for the claim_ids calls of one claim message, on a pool whose ``k`` stream had
    every block handed out and then freed in random order."""
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=n_blocks))
    per_stream = n_blocks // 2
    ids = list(pool.allocate_ids("k", per_stream * 16, "before"))
    random.Random(seed).shuffle(ids)
    pool.free_ids(ids)
    wanted = ids[: owners * groups]
    started = time.perf_counter()
    for n in range(owners):
        for block_id in wanted[n * groups : (n + 1) * groups]:
            pool.claim_ids(n, "k", [block_id])
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--n-blocks", type=int, help="pool size (default 131072, quick 8192)")
    args = parser.parse_args()
    owners = 256 if args.quick else 4096
    n_blocks = args.n_blocks or (8192 if args.quick else 1 << 17)
    groups = 16
    times = [claim_message_seconds(n_blocks, owners, groups, seed) for seed in range(args.rounds)]
    print(
        f"one claim message of {owners} owners x {groups} one-id groups, recycled ids, "
        f"{n_blocks:,}-block pool: median {statistics.median(times):.3f} s "
        f"(runs: {', '.join(f'{t:.3f}' for t in times)})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
