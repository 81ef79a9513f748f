#!/usr/bin/env python3
"""Decode speed and memory of the pooled KV cache against mlx-lm's stock KVCache, same run.

For each model and context: a stock ``KVCache`` and a pooled cache are both filled to the context
(random K/V written straight into every layer in 512-token chunks, as a chunked prefill would,
without minutes of CPU on a real prefill); then they decode in back-to-back pairs of short bursts
with ``mlx_lm.generate.generate_step`` (mlx-lm's own decode loop), alternating which goes first,
so both kinds run under the same machine load. Repeated over several fills. Reported: median
tokens/s of each kind, the median of the paired ratios (target >= 0.9), and the bytes
``MLXBlockStorage`` holds against blocks held x bytes per block (target <= 1.05x plus a fixed
overhead, which is 0 here). 4 bursts of 64 tokens cross block boundaries at every context (past
4,000 tokens the reserve is 15 blocks, so a growth falls inside the 260 decoded tokens).

    .venv/bin/python scripts/bench_cache.py                      # both models, ~10 min here
    .venv/bin/python scripts/bench_cache.py --models llama --rounds 5
    .venv/bin/python scripts/bench_cache.py --no-reserve         # the layout's counterfactual
    .venv/bin/python scripts/bench_cache.py --run-dir DIR        # blocks from a running vqpoold
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import vqpool.worker.kv.cache as pooled_cache
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from vqpool.shared import BlockPool, BlockPoolAllocator, PoolConfig
from vqpool.worker import KVLayout, MLXBlockStorage, make_pooled_cache
from vqpool.worker.models.tiny_models import build_tiny_model

FILL_CHUNK = 512


@dataclass
class Result:
    model: str
    context: int
    stock_tps: list[float]
    pooled_tps: list[float]
    pair_ratios: list[float]
    storage_bytes: int
    block_bytes: int
    blocks_held: int
    stock_bytes: int

    @property
    def speed_ratio(self) -> float:
        """Median over back-to-back (stock, pooled) bursts of pooled / stock tokens/s."""
        return statistics.median(self.pair_ratios)

    @property
    def bytes_ratio(self) -> float:
        return self.storage_bytes / self.block_bytes


def fill(cache: Sequence[Any], layout: KVLayout, n_tokens: int) -> None:
    """Put ``n_tokens`` of random K/V into every layer, ``FILL_CHUNK`` tokens per write."""
    mx.random.seed(1)
    done = 0
    while done < n_tokens:
        n = min(FILL_CHUNK, n_tokens - done)
        shape_k = (1, layout.n_kv_heads, n, layout.k_head_dim)
        shape_v = (1, layout.n_kv_heads, n, layout.v_head_dim)
        for layer in cache:
            keys = mx.random.normal(shape_k).astype(layout.dtype)
            values = mx.random.normal(shape_v).astype(layout.dtype)
            layer.update_and_fetch(keys, values)
        mx.eval([layer.state for layer in cache])
        done += n


def decode_tps(model: nn.Module, cache: Sequence[Any], n_tokens: int) -> float:
    """Tokens/s of ``n_tokens`` greedy decode steps after the first (which pays for setup)."""
    steps = generate_step(mx.array([7]), model, max_tokens=n_tokens + 1, prompt_cache=cache)
    next(steps)
    start = time.perf_counter()
    for _ in steps:
        pass
    return n_tokens / (time.perf_counter() - start)


def bench_one(
    name: str,
    model: nn.Module,
    pool: BlockPool,
    context: int,
    rounds: int,
    bursts: int,
    burst: int,
) -> Result:
    """``rounds`` x (fill both caches to ``context``, then ``bursts`` back-to-back pairs of
    ``burst``-token decodes, alternating which kind goes first). This machine's load changes
    on a scale of seconds; pairing measures both kinds under the same load."""
    layout = KVLayout.from_model(model, block_size=pool.config.block_size)
    storage = MLXBlockStorage(layout, separate_kv=pool.config.separate_kv)
    stock_tps: list[float] = []
    pooled_tps: list[float] = []
    ratios: list[float] = []
    storage_bytes = block_bytes = blocks_held = stock_bytes = 0
    for round_ in range(rounds):
        owner = f"bench-{uuid.uuid4().hex[:12]}"
        stock = make_prompt_cache(model)
        with make_pooled_cache(model, pool, owner, storage=storage) as pooled:
            fill(stock, layout, context)
            fill(pooled, layout, context)
            for i in range(bursts):
                if (round_ + i) % 2 == 0:
                    s_tps = decode_tps(model, stock, burst)
                    p_tps = decode_tps(model, pooled, burst)
                else:
                    p_tps = decode_tps(model, pooled, burst)
                    s_tps = decode_tps(model, stock, burst)
                if round_ == 0 and i == 0:
                    continue  # warm-up: MLX's buffer cache and code paths, for both kinds
                stock_tps.append(s_tps)
                pooled_tps.append(p_tps)
                ratios.append(p_tps / s_tps)
            mx.eval([c.state for c in pooled])
            blocks = pool.blocks_for(owner)
            storage_bytes = storage.nbytes
            block_bytes = sum(storage.bytes_per_block(b.stream) for b in blocks)
            blocks_held = len(blocks)
            stock_bytes = sum(c.nbytes for c in stock)
        assert storage.nbytes == 0 and pool.blocks_for(owner) == []
        del stock
        gc.collect()
        mx.clear_cache()
    return Result(
        name,
        context,
        stock_tps,
        pooled_tps,
        ratios,
        storage_bytes,
        block_bytes,
        blocks_held,
        stock_bytes,
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["llama", "llama-1024x8"])
    parser.add_argument("--contexts", nargs="+", type=int, default=[100, 1000, 4000])
    parser.add_argument("--rounds", type=int, default=3, help="fills per model and context")
    parser.add_argument("--bursts", type=int, default=4, help="decode pairs per fill")
    parser.add_argument("--burst", type=int, default=64, help="decode tokens per burst")
    parser.add_argument("--shared-kv", action="store_true", help="one 'kv' stream, not k and v")
    parser.add_argument("--run-dir", type=Path, help="take blocks from the vqpoold running here")
    parser.add_argument(
        "--no-reserve",
        action="store_true",
        help="grow by the missing blocks only (the layout choice's counterfactual, docs/cache.md)",
    )
    args = parser.parse_args(argv)
    if args.no_reserve:
        pooled_cache.RESERVE_DIVISOR = sys.maxsize

    config = PoolConfig(block_size=16, n_blocks=8192, separate_kv=not args.shared_kv)
    pool: BlockPool
    if args.run_dir is not None:
        from vqpool.worker import PoolClient

        pool = PoolClient(args.run_dir, name="bench-cache")
    else:
        pool = BlockPoolAllocator(config)

    header = (
        f"{'model':<14}{'ctx':>6}{'stock tok/s':>13}{'pooled tok/s':>14}{'ratio':>7}"
        f"{'blocks':>8}{'storage B':>13}{'blocks x B/blk':>16}{'ratio':>7}{'stock B':>13}"
    )
    print(
        f"pool: {type(pool).__name__}, streams {pool.config.streams}, block size "
        f"{pool.config.block_size}; {args.rounds} fills x {args.bursts} paired bursts of "
        f"{args.burst} decode tokens (first pair = warm-up); medians; ratio = median of "
        f"paired ratios; fixed storage overhead 0 B"
        f"{'; NO reserve' if args.no_reserve else ''}"
    )
    print(header)
    results: list[Result] = []
    for name in args.models:
        model, _ = build_tiny_model(name)
        for context in args.contexts:
            r = bench_one(name, model, pool, context, args.rounds, args.bursts, args.burst)
            results.append(r)
            print(
                f"{r.model:<14}{r.context:>6}{statistics.median(r.stock_tps):>13.1f}"
                f"{statistics.median(r.pooled_tps):>14.1f}{r.speed_ratio:>7.3f}"
                f"{r.blocks_held:>8}{r.storage_bytes:>13}{r.block_bytes:>16}"
                f"{r.bytes_ratio:>7.3f}{r.stock_bytes:>13}",
                flush=True,
            )
    worst = min(r.speed_ratio for r in results)
    worst_bytes = max(r.bytes_ratio for r in results)
    print(f"worst speed ratio {worst:.3f} (target >= 0.9); worst bytes ratio {worst_bytes:.3f}")
    close = getattr(pool, "close", None)
    if close is not None:
        close()


if __name__ == "__main__":
    main()
