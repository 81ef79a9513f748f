#!/usr/bin/env python3
"""Serving side by side: stock mlx_lm.server vs vqpool-worker (pooled and --no-pool), streaming.

Builds Hugging Face-format model directories with random weights and a ``tokenizers`` tokenizer
(small: hidden 256 x 4 layers, fp32; medium: hidden 1024 x 8 layers, bf16), then serves each
with three servers: stock ``python -m mlx_lm.server``, ``vqpool-worker`` drawing its KV cache
from a live ``vqpoold`` (private run directory), and ``vqpool-worker --no-pool``. In each round
the three are started and warmed up with one short request, then, for each concurrency ``c``,
each server in turn is sent a batch of ``c`` simultaneous streaming completions (the same
prompts, ~64 tokens each, for every server of a round; different between batches so
mlx_lm.server's prompt cache has nothing to reuse), and the three are stopped. Only one server
has work at a time (the others sit idle), and the order of the three rotates from batch to
batch: on a shared machine whose load drifts over minutes, the three batches of one
concurrency run within a minute or two of each other, not a whole server's run apart. Requests
are greedy (temperature 0) with ``max_tokens`` new tokens.

Measured client side, per batch: aggregate generated tokens per second (usage's completion
tokens of all requests / wall time from the first request sent to the last [DONE]), time to
first token (to the first event carrying text) p50 and p90, and request latency p50. Reported as
markdown tables: medians over rounds per server, and the ratios vqpool pooled / mlx_lm.server
and pooled / --no-pool (medians of the per-round ratios, with their quartiles from 4 rounds on,
e.g. ``0.97x (0.90-1.05)``). Every server must see the same number of prompt tokens for each
request (checked from usage).

    .venv/bin/python scripts/bench_vs_mlx_server.py                       # both models, 3 rounds
    .venv/bin/python scripts/bench_vs_mlx_server.py --models small --rounds 2
    .venv/bin/python scripts/bench_vs_mlx_server.py --quick               # a tiny smoke run
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from vqpool.worker.testing.http_client import request_json, stream_events
from vqpool.worker.testing.launch import DaemonProcess, WorkerProcess, stop_process
from vqpool.worker.testing.model_dirs import write_config_dir

_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}

# name -> (config.json args apart from the vocabulary, weight dtype). bf16 for the medium model:
# on MLX's CPU build bf16 decodes ~2.6x faster than fp16 (FACTS), fp32 is fastest for tiny ones.
MODELS: dict[str, tuple[dict[str, Any], mx.Dtype]] = {
    "tiny": (
        {
            **_LLAMA,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
        mx.float32,
    ),
    "small": (
        {
            **_LLAMA,
            "hidden_size": 256,
            "num_hidden_layers": 4,
            "intermediate_size": 704,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
        },
        mx.float32,
    ),
    "medium": (
        {
            **_LLAMA,
            "hidden_size": 1024,
            "num_hidden_layers": 8,
            "intermediate_size": 2816,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
        },
        mx.bfloat16,
    ),
}

SERVERS = ("mlx_lm.server", "vqpool pooled", "vqpool --no-pool")

READY_TIMEOUT = 300.0
REQUEST_TIMEOUT = 900.0

# Words the prompts are drawn from (the model directories' tokenizer was trained on this text).
_WORDS_TEXT = (
    "a key value cache keeps the keys and values of every token model has seen so that each new "
    "attends to past without computing it again grows with context one block sixteen slots at "
    "time two models on machine share pool small daemon hands out ids takes them back when "
    "request ends hello how are you say in five words why the quick brown fox jumps over lazy dog"
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", nargs="+", choices=sorted(MODELS), default=["small", "medium"],
        help="model directories to build and serve (default: small medium)",
    )  # fmt: skip
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 4, 8, 16],
        help="simultaneous requests per batch (default: 1 4 8 16)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default: 3)")
    parser.add_argument(
        "--max-tokens", type=int, default=128, help="tokens generated per request (default: 128)"
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=64, help="prompt length, about (default: 64)"
    )
    parser.add_argument(
        "--quick", action="store_true",
        help="a smoke run: the tiny model, concurrency 1 2, 1 round, 8 tokens",
    )  # fmt: skip
    args = parser.parse_args()
    if args.quick:
        args.models, args.concurrency, args.rounds, args.max_tokens = ["tiny"], [1, 2], 1, 8
    if args.rounds < 1 or args.max_tokens < 1 or min(args.concurrency) < 1:
        parser.error("--rounds, --max-tokens and --concurrency must be >= 1")
    return args


def never_emit_eos(model_dir: Path) -> None:
    """Zero the EOS row of the model's ``lm_head``: its logit is then 0 while the largest of the
    other random logits is positive, so greedy decoding never stops early and every request
    generates exactly ``max_tokens`` tokens on every server (the same work for all)."""
    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    path = str(model_dir / "model.safetensors")
    weights = mx.load(path)
    assert isinstance(weights, dict)
    head = weights["lm_head.weight"]
    weights["lm_head.weight"] = mx.where(
        (mx.arange(head.shape[0]) == eos)[:, None], mx.zeros_like(head), head
    )
    mx.save_safetensors(path, weights, metadata={"format": "mlx"})


# -- prompts --------------------------------------------------------------------------------------


def make_prompts(model_dir: Path, n: int, n_tokens: int, seed: int) -> list[str]:
    """``n`` different prompts of ``n_tokens`` tokens or a few more (whole words), each starting
    with different words so that no prompt cache finds a shared prefix."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rng = random.Random(seed)
    vocabulary = _WORDS_TEXT.split()
    prompts = []
    for _ in range(n):
        words: list[str] = []
        while len(tokenizer.encode(" ".join(words)).ids) < n_tokens:
            words.append(rng.choice(vocabulary))
        prompts.append(" ".join(words))
    return prompts


# -- servers --------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class MlxLmServer:
    """``python -m mlx_lm.server --model DIR --port P [ARGS]`` (stock settings but ``args``),
    output in a log."""

    def __init__(self, model_dir: Path, log_path: Path, args: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        argv = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), *args]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "WARNING"]
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=log)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mlx_lm.server exited:\n{self.log_path.read_text()[-4000:]}")
            try:
                if request_json(self.url, "GET", "/health", timeout=2.0).status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"mlx_lm.server not ready after {READY_TIMEOUT}s")

    def stop(self) -> None:
        stop_process(self.process, 15, 10.0)


def start_server(
    kind: str, model_dir: Path, log: Path, run_dir: Path, max_concurrent: int
) -> tuple[str, Callable[[], object]]:
    """Start one server of ``kind`` on ``model_dir`` logging to ``log`` (a new file: a worker's
    ready line is looked for there); its URL and how to stop it."""
    if kind == "mlx_lm.server":
        mlx = MlxLmServer(model_dir, log)
        try:
            mlx.wait_ready()
        except BaseException:
            mlx.stop()
            raise
        return mlx.url, mlx.stop
    worker_args = ["--max-concurrent", str(max_concurrent), "--log-level", "WARNING"]
    worker = WorkerProcess(
        str(model_dir),
        log,
        run_dir=run_dir,
        no_pool=kind == "vqpool --no-pool",
        args=worker_args,
    )
    try:
        worker.start(timeout=READY_TIMEOUT)
    except BaseException:
        worker.stop()
        raise
    return worker.url, worker.stop


# -- one batch ------------------------------------------------------------------------------------


@dataclass
class Stream:
    """One streamed request, timed from when it was sent."""

    ttft: float
    latency: float
    prompt_tokens: int
    completion_tokens: int
    retries: int


# Connection errors a request is sent again after, when no byte of its answer came: both servers
# are http.server ThreadingHTTPServers with a listen backlog of 5, which a burst of 16 connects
# can overflow under load. The retries are counted and reported; the wait counts in TTFT.
_RETRIED_ERRORS = (ConnectionResetError, ConnectionRefusedError, http.client.RemoteDisconnected)
MAX_ATTEMPTS = 5


def stream_one(url: str, prompt: str, max_tokens: int) -> Stream:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    attempt = 0
    while True:
        first: float | None = None
        usage: dict[str, int] | None = None
        events = 0
        try:
            for event in stream_events(url, "/v1/completions", body, timeout=REQUEST_TIMEOUT):
                events += 1
                if first is None and any(c.get("text") for c in event.get("choices") or []):
                    first = time.perf_counter()
                if event.get("usage"):
                    usage = event["usage"]
        except _RETRIED_ERRORS:
            attempt += 1
            if events or attempt == MAX_ATTEMPTS:
                raise
            time.sleep(0.1 * attempt)
            continue
        done = time.perf_counter()
        if usage is None:
            raise RuntimeError(f"{url}: the stream carried no usage")
        return Stream(
            ttft=(first if first is not None else done) - sent,
            latency=done - sent,
            prompt_tokens=usage["prompt_tokens"],
            completion_tokens=usage["completion_tokens"],
            retries=attempt,
        )


@dataclass
class Batch:
    """What one server did with one batch of simultaneous requests."""

    tokens_per_s: float
    ttft_p50: float
    ttft_p90: float
    latency_p50: float
    prompt_tokens: list[int]
    completion_tokens: int
    retries: int


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def run_batch(url: str, prompts: list[str], max_tokens: int) -> Batch:
    with ThreadPoolExecutor(len(prompts)) as pool:
        started = time.perf_counter()
        streams = list(pool.map(lambda p: stream_one(url, p, max_tokens), prompts))
        elapsed = time.perf_counter() - started
    generated = sum(s.completion_tokens for s in streams)
    return Batch(
        tokens_per_s=generated / elapsed,
        ttft_p50=percentile([s.ttft for s in streams], 0.5),
        ttft_p90=percentile([s.ttft for s in streams], 0.9),
        latency_p50=percentile([s.latency for s in streams], 0.5),
        prompt_tokens=[s.prompt_tokens for s in streams],
        completion_tokens=generated,
        retries=sum(s.retries for s in streams),
    )


# -- rounds and report ----------------------------------------------------------------------------


def bench_model(
    name: str, model_dir: Path, args: argparse.Namespace, base: Path, run_dir: Path
) -> dict[tuple[str, int], list[Batch]]:
    """(server, concurrency) -> one Batch per round."""
    results: dict[tuple[str, int], list[Batch]] = {
        (kind, c): [] for kind in SERVERS for c in args.concurrency
    }
    for round_no in range(args.rounds):
        prompts = {
            c: make_prompts(model_dir, c, args.prompt_tokens, seed=1000 * round_no + c)
            for c in args.concurrency
        }
        warm_up = make_prompts(model_dir, 1, 8, seed=-1 - round_no)
        urls: dict[str, str] = {}
        stops: list[Callable[[], object]] = []
        try:
            for kind in SERVERS:
                log = base / f"{name}-{round_no}-{kind.replace(' ', '_').replace('-', '')}.log"
                url, stop = start_server(kind, model_dir, log, run_dir, max(args.concurrency))
                urls[kind] = url
                stops.append(stop)
                run_batch(urls[kind], warm_up, 4)
            for i, c in enumerate(args.concurrency):
                shift = (round_no + i) % 3
                for kind in SERVERS[shift:] + SERVERS[:shift]:
                    batch = run_batch(urls[kind], prompts[c], args.max_tokens)
                    results[(kind, c)].append(batch)
                    print(
                        f"  {name} round {round_no + 1} {kind:16} c={c:<3} "
                        f"{batch.tokens_per_s:7.1f} tok/s  TTFT p50 {batch.ttft_p50:6.2f} s  "
                        f"({batch.completion_tokens} tokens)",
                        file=sys.stderr,
                        flush=True,
                    )
        finally:
            for stop in stops:
                stop()
        for c in args.concurrency:
            seen = {kind: results[(kind, c)][-1].prompt_tokens for kind in SERVERS}
            if len({tuple(tokens) for tokens in seen.values()}) != 1:
                raise RuntimeError(f"{name} c={c}: servers saw different prompt lengths: {seen}")
    return results


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def median_of(batches: list[Batch], field: str) -> float:
    return statistics.median(getattr(b, field) for b in batches)


def ratio_text(top: list[Batch], bottom: list[Batch], field: str) -> str:
    """The median of the per-round ratios ``top / bottom``, and from 4 rounds their first and
    third quartiles: on a shared machine adjacent batches differ by 10-30%, and the spread says
    how far a median can be trusted."""
    ratios = [getattr(t, field) / getattr(b, field) for t, b in zip(top, bottom, strict=True)]
    text = f"{statistics.median(ratios):.2f}x"
    if len(ratios) >= 4:
        first, _, third = statistics.quantiles(ratios, n=4)
        text += f" ({first:.2f}-{third:.2f})"
    return text


def report(
    name: str, results: dict[tuple[str, int], list[Batch]], args: argparse.Namespace
) -> None:
    mlx, pooled, stock = SERVERS
    config, dtype = MODELS[name]
    layers = config["num_hidden_layers"]
    print(f"\n### {name}: {config['hidden_size']} hidden x {layers} layers, {_dtype_name(dtype)}\n")
    print(
        "| concurrency | mlx_lm.server tok/s | vqpool pooled tok/s | vqpool --no-pool tok/s "
        "| pooled / mlx_lm.server | pooled / --no-pool | TTFT p50 pooled / mlx_lm.server |"
    )
    print("|---|---|---|---|---|---|---|")
    for c in args.concurrency:
        r = {kind: results[(kind, c)] for kind in SERVERS}
        print(
            f"| {c} | {median_of(r[mlx], 'tokens_per_s'):.1f} "
            f"| {median_of(r[pooled], 'tokens_per_s'):.1f} "
            f"| {median_of(r[stock], 'tokens_per_s'):.1f} "
            f"| {ratio_text(r[pooled], r[mlx], 'tokens_per_s')} "
            f"| {ratio_text(r[pooled], r[stock], 'tokens_per_s')} "
            f"| {ratio_text(r[pooled], r[mlx], 'ttft_p50')} |"
        )
    print(
        "\n| concurrency | server | TTFT p50 (s) | TTFT p90 (s) | latency p50 (s) "
        "| generated tokens per request | connects retried |"
    )
    print("|---|---|---|---|---|---|---|")
    for c in args.concurrency:
        for kind in SERVERS:
            batches = results[(kind, c)]
            per_request = statistics.median(b.completion_tokens / c for b in batches)
            print(
                f"| {c} | {kind} | {median_of(batches, 'ttft_p50'):.3f} "
                f"| {median_of(batches, 'ttft_p90'):.3f} | {median_of(batches, 'latency_p50'):.3f} "
                f"| {per_request:.0f} | {sum(b.retries for b in batches)} |"
            )


def _load() -> str:
    """The 1/5/15-minute load averages: how busy the machine was (other processes too)."""
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> int:
    args = parse_args()
    base = Path(tempfile.mkdtemp(prefix="vqvsmlx-", dir="/tmp"))
    run_dir = base / "run"
    daemon = DaemonProcess(run_dir, "--n-blocks", "16384", "--log-level", "WARNING")
    try:
        daemon.start()
        print(
            f"streaming completions, ~{args.prompt_tokens}-token prompts, {args.max_tokens} "
            f"tokens generated, temperature 0; concurrency {args.concurrency}; {args.rounds} "
            "round(s), one server busy at a time, order rotating per batch; medians over rounds "
            "(ratios: medians of per-round ratios, quartiles in brackets); load average "
            f"{_load()} at start",
            flush=True,
        )
        for name in args.models:
            config, dtype = MODELS[name]
            model_dir = write_config_dir(base / name, config, seed=0, dtype=dtype)
            never_emit_eos(model_dir)
            results = bench_model(name, model_dir, args, base, run_dir)
            report(name, results, args)
        print(f"\nload average {_load()} at the end (2 vCPUs shared: read ratios, not absolutes)")
        return 0
    finally:
        daemon.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
