#!/usr/bin/env python3
"""Prompt cache: vqpool-worker (pooled KV cache with its prompt cache) vs stock mlx_lm.server.

Both serve the same model directory, built here: a random-weight llama (hidden 256 x 4 layers by
default, fp32, the byte-level BPE tokenizer and chat template of
``worker/testing/model_dirs.py``). Two traces, each run in rounds that alternate the two servers,
every chat or round with a system prompt of its own (its first words name it), so none reuses
another's cache and turn 1 is always cold:

(a) chat: ``--chats`` chats per round on each server, each one user with a system prompt of
    ``--system-words`` words, ``--turns`` turns of ``--max-tokens`` tokens each, streaming;
    each turn sends the whole history (the previous answers as the server streamed them). The
    two servers' chats advance turn by turn, alternately (the order flips every turn), so each
    turn on one server is measured next to the same turn on the other: the machine's load
    (other processes) weighs on both alike. TTFT (seconds from sending to the first streamed
    event) per turn: the median over all chats per server, and the median of the ratios
    vqpool / stock of the pairs measured side by side; the tokens each server prefilled
    (``usage``: prompt tokens minus ``prompt_tokens_details.cached_tokens``), and how many
    answers were the same on both (a pair shares its system prompt; see :func:`run_chats`).
(b) shared system prompt: ``--users`` users send one question each at once, all with the same
    system prompt. TTFT p50 and p90 over users and rounds, aggregate generated tok/s (all
    tokens over the wall time of the batch): medians over rounds, and ratios.

The worker's ``/v1/stats`` counters give the prompt-cache hits and tokens reused per trace
against what the trace makes possible (chat: turns 2..N of every round; shared: all users but
the first of every round). Last, in-process on the same model: what the cache's copies cost
(reuse of N cached tokens into a request's blocks, store of N tokens) next to the prefill of
the same N tokens.

    .venv/bin/python scripts/bench_prompt_cache.py                    # 3 rounds
    .venv/bin/python scripts/bench_prompt_cache.py --rounds 5 --system-words 900
    .venv/bin/python scripts/bench_prompt_cache.py --quick            # smoke run (tests)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from vqpool.worker.models.tiny_models import build_random_model
from vqpool.worker.testing.http_client import request_json, stream_events
from vqpool.worker.testing.launch import DaemonProcess, WorkerProcess
from vqpool.worker.testing.model_dirs import ARCHITECTURES, write_model_dir

SYSTEM_TEXT = (
    "the pool hands out blocks of sixteen token slots to every model that asks and takes them "
    "back when a request ends so that two models on one machine share one budget of memory"
)
WORDS = SYSTEM_TEXT.split(" ")


COPY_TOKENS = 1000
"""Tokens whose reuse, store and prefill the in-process measurement times."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds per trace")
    parser.add_argument("--system-words", type=int, default=300, help="system prompt words")
    parser.add_argument("--turns", type=int, default=4, help="turns of the chat trace")
    parser.add_argument("--chats", type=int, default=2, help="chats per round per server")
    parser.add_argument("--users", type=int, default=8, help="users of the shared trace")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the model")
    parser.add_argument("--layers", type=int, default=4, help="layers of the model")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 1 round of everything, tiny sizes"
    )
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.system_words, args.turns, args.users, args.chats = 1, 40, 2, 2, 1
        args.max_tokens, args.hidden, args.layers = 4, 64, 2
    return args


def build_model_dir(path: Path, hidden: int, layers: int) -> Path:
    """``write_model_dir``'s llama with ``hidden`` x ``layers`` (its tokenizer, new weights)."""
    write_model_dir(path, "llama")
    config = json.loads((path / "config.json").read_text())
    config.update(
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    assert set(config) >= set(ARCHITECTURES["llama"])
    model = build_random_model(config, seed=0)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


class StockServer:
    """``mlx_lm.server --model DIR`` on a free port."""

    def __init__(self, model_dir: Path, port: int, log_path: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                [
                    *(sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir)),
                    *("--host", "127.0.0.1", "--port", str(port)),
                ],
                stdout=log,
                stderr=log,
            )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mlx_lm.server exited: {log_path.read_text()[-2000:]}")
            try:
                if request_json(self.url, "GET", "/v1/models", timeout=1).status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError("mlx_lm.server not ready after 120 s")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def system_prompt(round_id: str, n_words: int) -> str:
    words = [WORDS[i % len(WORDS)] for i in range(n_words)]
    return f"Round {round_id}. You are a helpful assistant. " + " ".join(words)


@dataclass
class Turn:
    """One streamed chat completion as the client saw it."""

    ttft: float  # seconds from sending to the first event
    answer: str
    prefilled: int  # prompt tokens the server computed (prompt - cached, from its usage)


def chat_turn(url: str, messages: list[dict[str, str]], max_tokens: int) -> Turn:
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    ttft = None
    parts: list[str] = []
    prefilled = -1
    for event in stream_events(url, "/v1/chat/completions", body):
        if ttft is None:
            ttft = time.perf_counter() - started
        for choice in event.get("choices", []):
            parts.append((choice.get("delta") or {}).get("content") or "")
        usage = event.get("usage")
        if usage:
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            prefilled = usage["prompt_tokens"] - cached
    assert ttft is not None
    return Turn(ttft, "".join(parts), prefilled)


def run_chats(
    servers: dict[str, str], round_number: int, args: argparse.Namespace
) -> tuple[dict[str, list[list[Turn]]], int]:
    """Trace (a), one round: ``args.chats`` chats per server, every chat with a system prompt
    of its own, the same on both servers (both start from the same prompt); the servers' chats
    advance turn by turn, alternately. Each chat's turns per server, and how many turns got the
    same answer from both (greedy answers may differ: the servers split a prefill differently,
    fp32 sums round differently, and a later turn's prompt holds the earlier answers)."""
    names = list(servers)
    histories = {
        (name, chat): [
            {
                "role": "system",
                "content": system_prompt(f"chat-{round_number}-{chat}", args.system_words),
            }
        ]
        for name in names
        for chat in range(args.chats)
    }
    turns: dict[str, list[list[Turn]]] = {name: [[] for _ in range(args.chats)] for name in names}
    flip = round_number
    for turn in range(args.turns):
        for chat in range(args.chats):
            flip += 1
            for name in names if flip % 2 == 0 else names[::-1]:
                messages = histories[name, chat]
                messages.append(
                    {"role": "user", "content": f"Question {turn + 1}: why share a pool?"}
                )
                got = chat_turn(servers[name], messages, args.max_tokens)
                turns[name][chat].append(got)
                messages.append({"role": "assistant", "content": got.answer})
    same = sum(
        len({str(histories[name, chat][1 + 2 * turn + 1]) for name in names}) == 1
        for chat in range(args.chats)
        for turn in range(args.turns)
    )
    return turns, same


def run_shared(url: str, round_id: str, args: argparse.Namespace) -> tuple[list[float], float]:
    """Trace (b) once: TTFT per user, and generated tokens per second of the whole batch."""
    system = system_prompt(round_id, args.system_words)

    def one(user: int) -> tuple[float, int]:
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"I am user {user}: say hello."},
        ]
        body = {
            "messages": messages,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "stream_options": {"include_usage": True},
        }
        started = time.perf_counter()
        ttft = None
        tokens = 0
        for event in stream_events(url, "/v1/chat/completions", body):
            if ttft is None:
                ttft = time.perf_counter() - started
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
        assert ttft is not None
        return ttft, tokens

    with ThreadPoolExecutor(args.users) as pool:
        started = time.perf_counter()
        results = list(pool.map(one, range(args.users)))
        elapsed = time.perf_counter() - started
    return [ttft for ttft, _ in results], sum(n for _, n in results) / elapsed


def cache_counters(url: str) -> dict[str, int]:
    stats: dict[str, int] = request_json(url, "GET", "/v1/stats").body["prompt_cache"]
    return stats


def alternate(
    servers: dict[str, str], trace: str, rounds: int, run: Callable[[str, str], Any]
) -> dict[str, list[Any]]:
    """``run(url, round_id)`` per server per round, the order flipping every round; round ids
    are unique across traces, servers and rounds."""
    results: dict[str, list[Any]] = {name: [] for name in servers}
    names = list(servers)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            results[name].append(run(servers[name], f"{trace}-{r}-{name}"))
    return results


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def copy_costs(model_dir: Path, n_tokens: int) -> dict[str, float]:
    """In-process medians (ms) of reuse and store of ``n_tokens`` cached tokens, and of the
    prefill of the same tokens, on the benchmark's model."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from vqpool.shared import BlockPoolAllocator, PoolConfig
    from vqpool.worker.kv.cache import make_pooled_cache
    from vqpool.worker.kv.cache_source import PooledCacheSource

    model = load(str(model_dir))[0]
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=1 << 14))
    source = PooledCacheSource(model, pool)
    cache = source.attach_prompt_cache(owner_prefix="b", max_bytes=1 << 34)
    tokens = [(7 * i) % 300 + 4 for i in range(n_tokens + 1)]
    times: dict[str, list[float]] = {"prefill_ms": [], "store_ms": [], "reuse_ms": []}
    for i in range(6):
        request = make_pooled_cache(model, pool, f"r{i}", storage=cache.storage)
        request.sequence.reserve(n_tokens + 2)
        started = time.perf_counter()
        next(generate_step(mx.array(tokens), model, max_tokens=1, prompt_cache=request))
        times["prefill_ms"].append(time.perf_counter() - started)
        cache.drop()
        started = time.perf_counter()
        cache.store(tokens, [layer.state for layer in request])
        times["store_ms"].append(time.perf_counter() - started)
        request.release()
        reader = make_pooled_cache(model, pool, f"q{i}", storage=cache.storage)
        reader.sequence.reserve(n_tokens + 2)
        started = time.perf_counter()
        reused = cache.reuse(tokens, reader)
        times["reuse_ms"].append(time.perf_counter() - started)
        assert reused == n_tokens
        reader.release()
    return {k: 1000 * statistics.median(v[1:]) for k, v in times.items()}


def main() -> int:
    args = parse_args()
    base = Path(tempfile.mkdtemp(prefix="vqpc", dir="/tmp"))
    daemon = None
    worker = None
    stock = None
    try:
        model_dir = build_model_dir(base / "model", args.hidden, args.layers)
        run_dir = base / "run"
        daemon = DaemonProcess(
            run_dir, "--n-blocks", "65536", log_path=base / "vqpoold.log"
        ).start()
        worker = WorkerProcess(
            str(model_dir), base / "worker.log", run_dir=run_dir, args=["--max-concurrent", "8"]
        ).start(timeout=300)
        stock = StockServer(model_dir, free_port(), base / "stock.log")
        servers = {"stock": stock.url, "vqpool": worker.url}
        print(
            f"model: llama {args.hidden} x {args.layers} layers (fp32, random weights); "
            f"system prompt {args.system_words} words; {args.max_tokens} tokens per answer; "
            f"{args.rounds} rounds",
            flush=True,
        )

        for url in servers.values():  # one uncounted request each: loading, first compiles
            chat_turn(url, [{"role": "user", "content": "warm up"}], 4)
        before = cache_counters(worker.url)
        chats: dict[str, list[list[Turn]]] = {name: [] for name in servers}
        same_answers = 0
        for r in range(args.rounds):
            got, same = run_chats(servers, r, args)
            same_answers += same
            for name, turns in got.items():
                chats[name].extend(turns)
        after_chat = cache_counters(worker.url)
        n_chats = args.rounds * args.chats
        print(f"\n(a) chat: TTFT per turn (s), medians over {n_chats} chats per server")
        print(
            "| turn | mlx_lm.server | vqpool-worker | ratio (medians) | median of pair ratios "
            "| tokens prefilled (medians) |"
        )
        print("|---|---|---|---|---|---|")
        for turn in range(args.turns):
            stock_t = [c[turn].ttft for c in chats["stock"]]
            pool_t = [c[turn].ttft for c in chats["vqpool"]]
            ratio = statistics.median(p / s for p, s in zip(pool_t, stock_t, strict=True))
            stock_m, pool_m = statistics.median(stock_t), statistics.median(pool_t)
            stock_n = statistics.median(c[turn].prefilled for c in chats["stock"])
            pool_n = statistics.median(c[turn].prefilled for c in chats["vqpool"])
            print(
                f"| {turn + 1} | {stock_m:.3f} | {pool_m:.3f} | {pool_m / stock_m:.2f} | "
                f"{ratio:.2f} | {stock_n:g} / {pool_n:g} |"
            )
        print(f"answers the same on both servers: {same_answers} of {n_chats * args.turns} turns")
        hits = after_chat["hits"] - before["hits"]
        possible = n_chats * (args.turns - 1)
        print(
            f"vqpool-worker cache: {hits} hits of {possible} possible, "
            f"{after_chat['tokens_reused'] - before['tokens_reused']} tokens reused, "
            f"{after_chat['tokens_prefilled'] - before['tokens_prefilled']} prefilled"
        )

        shared = alternate(servers, "shared", args.rounds, lambda url, r: run_shared(url, r, args))
        after_shared = cache_counters(worker.url)
        print(f"\n(b) {args.users} users sharing a system prompt: TTFT (s) and aggregate tok/s")
        print("| server | TTFT p50 | TTFT p90 | tok/s |")
        print("|---|---|---|---|")
        summary: dict[str, tuple[float, float, float]] = {}
        for name, rounds in shared.items():
            ttfts = [t for ttft_list, _ in rounds for t in ttft_list]
            rate = statistics.median(r for _, r in rounds)
            summary[name] = (quantile(ttfts, 0.5), quantile(ttfts, 0.9), rate)
            label = "mlx_lm.server" if name == "stock" else "vqpool-worker"
            p50, p90, _ = summary[name]
            print(f"| {label} | {p50:.3f} | {p90:.3f} | {rate:.1f} |")
        s, v = summary["stock"], summary["vqpool"]
        print(
            f"ratios vqpool / stock: TTFT p50 {v[0] / s[0]:.2f}, p90 {v[1] / s[1]:.2f}, "
            f"tok/s {v[2] / s[2]:.2f}"
        )
        hits = after_shared["hits"] - after_chat["hits"]
        possible = args.rounds * (args.users - 1)
        print(
            f"vqpool-worker cache: {hits} hits of {possible} possible, "
            f"{after_shared['tokens_reused'] - after_chat['tokens_reused']} tokens reused"
        )
        costs = copy_costs(model_dir, COPY_TOKENS)
        print(
            f"\ncopy costs in-process, {COPY_TOKENS} tokens: prefill "
            f"{costs['prefill_ms']:.1f} ms, store {costs['store_ms']:.2f} ms, reuse "
            f"{costs['reuse_ms']:.2f} ms"
        )
    finally:
        for process in (stock, worker, daemon):
            if process is not None:
                process.stop()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
