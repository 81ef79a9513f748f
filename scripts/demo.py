#!/usr/bin/env python3
"""vqpool demo: two requests share one block pool (in-process, until the daemon lands)."""

from __future__ import annotations

from vqpool.shared import BlockPoolAllocator, BlockPoolExhaustedError, PoolConfig


def main() -> None:
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=64))
    print(f"pool: {pool.n_total('k')} K blocks + {pool.n_total('v')} V blocks of 16 tokens")
    for owner, tokens in (("chat-1", 200), ("chat-2", 300)):
        for stream in ("k", "v"):
            pool.allocate(stream, tokens, owner)
        print(f"{owner}: {tokens} tokens -> {pool.n_blocks_for(owner)} blocks")
    try:
        pool.allocate("k", 16 * 20, "chat-3")
    except BlockPoolExhaustedError as exc:
        print(f"chat-3 waits: {exc}")
    pool.free_all("chat-1")
    print(f"chat-1 done; {pool.n_free('k')} K blocks free")
    print(pool.stats)


if __name__ == "__main__":
    main()
