#!/usr/bin/env python3
"""Serving throughput: vqpool-worker with the pooled KV cache vs the same worker with stock caches.

Two worker processes serve the same built-in model through the same code path: one draws its
KV cache from a real vqpoold (``--run-dir``), the other uses stock mlx-lm caches
(``--no-pool``). For each concurrency (1 and 4 requests in flight), each round sends the same
batch of greedy requests to one worker, then to the other (the order alternates between
rounds), and measures generated tokens per second of wall time, client side, from the first
request sent to the last answer. Reported: the median over rounds for each worker, and the
median of the per-round ratios pooled / stock (target >= 0.9).

    .venv/bin/python scripts/bench_serving.py                  # builtin:llama, 7 rounds
    .venv/bin/python scripts/bench_serving.py --rounds 11 --max-tokens 512
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vqpool.worker.testing.http_client import request_json
from vqpool.worker.testing.launch import DaemonProcess, WorkerProcess


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:llama", help="a builtin:NAME model")
    parser.add_argument("--rounds", type=int, default=7, help="counted rounds per concurrency")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per request")
    parser.add_argument("--prompt-tokens", type=int, default=100, help="prompt length")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 4], help="requests in flight"
    )
    return parser.parse_args()


def run_batch(url: str, n: int, prompt: list[int], max_tokens: int) -> float:
    """Send ``n`` requests at once; generated tokens per second of wall time."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    with ThreadPoolExecutor(n) as pool:
        started = time.perf_counter()
        replies = list(
            pool.map(lambda _: request_json(url, "POST", "/v1/completions", body), range(n))
        )
        elapsed = time.perf_counter() - started
    tokens = 0
    for reply in replies:
        if reply.status != 200:
            raise RuntimeError(f"{url}: HTTP {reply.status}: {reply.body}")
        tokens += reply.body["usage"]["completion_tokens"]
    return tokens / elapsed


def main() -> int:
    args = parse_args()
    base = Path(tempfile.mkdtemp(prefix="vqbench-", dir="/tmp"))
    run_dir = base / "run"
    max_conc = str(max(args.concurrency))
    daemon = DaemonProcess(run_dir, "--n-blocks", "8192", "--log-level", "WARNING")
    workers: dict[str, WorkerProcess] = {}
    try:
        daemon.start()
        worker_args = ["--max-concurrent", max_conc, "--log-level", "WARNING"]
        # Every request sends the same prompt: without the prompt cache, so that both workers
        # prefill it and the ratio measures the KV layout (bench_prompt_cache.py measures it).
        workers["pooled"] = WorkerProcess(
            args.model,
            base / "pooled.log",
            run_dir=run_dir,
            args=[*worker_args, "--prompt-cache-bytes", "0"],
        ).start(wait=False)
        workers["stock"] = WorkerProcess(
            args.model, base / "stock.log", no_pool=True, args=worker_args
        ).start(wait=False)
        for worker in workers.values():
            worker.wait_ready()
        prompt = [(7 * i + 3) % 256 for i in range(args.prompt_tokens)]
        print(
            f"model {args.model}, prompt {args.prompt_tokens} tokens, {args.max_tokens} new "
            f"tokens per request, {args.rounds} rounds (+1 warm-up)\n"
        )
        print("| concurrency | stock tok/s | pooled tok/s | ratio (median of rounds) |")
        print("|---|---|---|---|")
        for n in args.concurrency:
            results: dict[str, list[float]] = {"pooled": [], "stock": []}
            ratios: list[float] = []
            for round_no in range(args.rounds + 1):
                order = ["pooled", "stock"] if round_no % 2 else ["stock", "pooled"]
                got = {
                    kind: run_batch(workers[kind].url, n, prompt, args.max_tokens) for kind in order
                }
                if round_no == 0:
                    continue  # warm-up
                for kind, value in got.items():
                    results[kind].append(value)
                ratios.append(got["pooled"] / got["stock"])
            print(
                f"| {n} | {statistics.median(results['stock']):.0f} | "
                f"{statistics.median(results['pooled']):.0f} | "
                f"{statistics.median(ratios):.3f} |",
                flush=True,
            )
        print("\nper-round ratios are pooled / stock of the same round (same machine load)")
        return 0
    finally:
        for worker in workers.values():
            worker.stop()
        daemon.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
