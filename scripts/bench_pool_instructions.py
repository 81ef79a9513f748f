#!/usr/bin/env python3
"""Instructions per call of the allocator's hot paths beside the seed's, counted by callgrind.

Wall-clock figures on a shared machine swing with the neighbours' load; an instruction count
does not. Each (allocator, operation) runs under ``valgrind --tool=callgrind`` twice, with a
short and a long loop; the difference over the extra iterations is the count per iteration
(start-up, imports and warm-up cancel out). Needs valgrind.

    scripts/bench_pool_instructions.py          # 2,000 and 10,000 iterations
    scripts/bench_pool_instructions.py --quick  # 200 and 1,000
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

OPERATIONS = {
    "one": "allocate(1 block)+free",
    "many": "allocate(256 blocks)+free_all",
    "ids": "allocate_ids(1 block)+free_ids",
}
SCALE = {"many": 20}
"""Operations run this many times fewer iterations (the seed's 256 blocks cost ~1.4M each)."""


def run_loop(engine: str, op: str, loops: int) -> None:
    """The measured loop itself (in the process valgrind runs)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import seed_pool
    from vqpool.shared import BlockPoolAllocator, PoolConfig

    pool = (
        BlockPoolAllocator(PoolConfig(n_blocks=1 << 14))
        if engine == "ours"
        else seed_pool.BlockPoolAllocator(seed_pool.PoolConfig(n_blocks=1 << 14))
    )

    def body(n: int) -> None:
        if op == "one":
            allocate, free = pool.allocate, pool.free
            for _ in range(n):
                free(allocate("k", 1, 1))
        elif op == "many":
            allocate, free_all = pool.allocate, pool.free_all
            for _ in range(n):
                allocate("k", 256 * 16, 1)
                free_all(1)
        else:
            allocate_ids, free_ids = pool.allocate_ids, pool.free_ids
            for _ in range(n):
                free_ids(allocate_ids("k", 1, 1))

    body(20)  # warm up
    body(loops)


def instructions(engine: str, op: str, loops: int) -> int:
    """Instructions callgrind counts for a whole run of ``loops`` iterations."""
    done = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            __file__,
            "--loop",
            engine,
            op,
            str(loops),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    found = re.search(r"Collected : (\d+)", done.stderr)
    if found is None:
        raise RuntimeError(f"no callgrind total in:\n{done.stderr}")
    return int(found.group(1))


def per_iteration(engine: str, op: str, short: int, long: int) -> float:
    short, long = short // SCALE.get(op, 1), long // SCALE.get(op, 1)
    return (instructions(engine, op, long) - instructions(engine, op, short)) / (long - short)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter loops")
    parser.add_argument("--loop", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loop:
        engine, op, loops = args.loop
        run_loop(engine, op, int(loops))
        return
    short, long = (200, 1_000) if args.quick else (2_000, 10_000)
    print(
        f"instructions per iteration (callgrind, {long:,} minus {short:,} iterations; "
        f"a {SCALE['many']}th of those for 256 blocks)"
    )
    print(f"{'operation':<32}{'ours':>12}{'seed':>12}{'seed / ours':>13}")
    for op, name in OPERATIONS.items():
        ours = per_iteration("ours", op, short, long)
        if op == "ids":  # the seed has no ids path: beside its allocate(1 block)+free
            seed = per_iteration("seed", "one", short, long)
        else:
            seed = per_iteration("seed", op, short, long)
        print(f"{name:<32}{ours:>12,.0f}{seed:>12,.0f}{seed / ours:>12.2f}x")


if __name__ == "__main__":
    main()
