#!/usr/bin/env python3
"""The front door (``vqpool serve``) measured against its own workers and against mlx_lm.server.

Three parts, in one run, with real processes on private run directories:

1. **Overhead.** One ``vqpool serve`` serving model A (prompt cache off, so that a prompt sent
   twice costs the same both times), its worker loaded; its URL comes from the control socket
   (``FrontDoorClient(run_dir).models()``, row ``url``). A batch is ``c`` greedy completions
   streamed at once. Each round sends ``--batches`` batches through the front door and as many,
   the same requests, straight to that same worker process, interleaved A B B A A B B A (A the
   front door in even rounds, the worker in odd ones), so that the drift of a shared machine
   hits both paths alike. Per round and path, client side: time to first token p50 (to the
   first event with text) over its requests, and aggregate generated tokens per second (its
   completion tokens / its batches' wall time). Reported: the medians over rounds, the median
   of the per-round deltas (ms) and ratios, with their spread (min to max of rounds).
   Targets: TTFT at most +5 ms p50, tokens/s at least 0.98x.
   Also the front door's CPU time (user + system, psutil) per proxied token, next to the
   worker's CPU time per generated token over the same batches.
2. **Two models that do not fit together.** ``vqpool serve --model A --model B --max-loaded
   1``; requests as an editor's two-model mode sends them: A, B, A, B ... one after another,
   then pairs (A and B sent at once). Reported: failed requests (target 0), loads (the rows'
   ``loads`` summed) against the fewest the sequence forces, and whether every response text
   equals that of the same request (temperature 0) sent straight to the model's worker alone
   (loaded by hand on the same front door before the sequence, with no other request running).
3. **Cold start.** Time to first token of a model not loaded: a fresh ``vqpool serve --model
   DIR`` (its ready line, then the request, which loads the model) vs ``python -m
   mlx_lm.server --model DIR`` started by hand and sent the same request once ``/health``
   answers. DIR is model A when it is a directory, else a tiny llama directory written here
   (mlx_lm.server cannot load ``builtin:NAME``). Both from process start; the front door's
   request-to-first-token (server up, model not loaded) apart.

    .venv/bin/python scripts/bench_front_door.py                 # built-in models, ~3 min
    .venv/bin/python scripts/bench_front_door.py --quick         # a smoke run, < 1 min
    .venv/bin/python scripts/bench_front_door.py --json          # the figures as JSON
    .venv/bin/python scripts/bench_front_door.py --model DIR_A --model DIR_B
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_mlx_server import MlxLmServer, percentile
from vqpool.worker.testing.http_client import HttpStatusError, request_json, stream_events
from vqpool.worker.testing.launch import ServeProcess
from vqpool.worker.testing.model_dirs import write_model_dir

READY_TIMEOUT = 120.0
LOAD_TIMEOUT = 600.0
REQUEST_TIMEOUT = 600.0

# Words the prompts are made of: whole words, different first words from request to request.
_WORDS_TEXT = (
    "a key value cache keeps the keys and values of every token the model has seen so that "
    "each new one attends to the past without computing it again two models on one machine "
    "share a pool the daemon hands out ids and takes them back when a request ends"
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", action="append", metavar="PATH",
        help="model A, then model B (a directory, a hub id or builtin:NAME; "
        "default: builtin:llama, builtin:qwen3)",
    )  # fmt: skip
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 8],
        help="requests at once in an overhead batch (default: 1 8)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=7, help="overhead rounds (default: 7)")
    parser.add_argument(
        "--batches", type=int, default=4,
        help="overhead batches per path and round, interleaved (default: 4)",
    )  # fmt: skip
    parser.add_argument(
        "--max-tokens", type=int, default=96, help="tokens generated per request (default: 96)"
    )
    parser.add_argument(
        "--alternations", type=int, default=8,
        help="two-model part: requests sent one after another, A, B, A ... (default: 8)",
    )  # fmt: skip
    parser.add_argument(
        "--pairs", type=int, default=4,
        help="two-model part: then pairs of requests, A and B sent at once (default: 4)",
    )  # fmt: skip
    parser.add_argument(
        "--cold-rounds", type=int, default=3, help="cold starts of each server (default: 3)"
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument(
        "--quick", action="store_true",
        help="a smoke run: 2 rounds of 2 batches, 16 tokens, 4 alternations, "
        "1 pair, 1 cold start",
    )  # fmt: skip
    args = parser.parse_args()
    args.model = args.model or ["builtin:llama", "builtin:qwen3"]
    if len(args.model) != 2:
        parser.error("give --model twice (model A and model B) or not at all")
    if args.model[0] == args.model[1]:
        parser.error("model A and model B must differ")
    if args.quick:
        args.rounds, args.batches, args.max_tokens = 2, 2, 16
        args.alternations, args.pairs, args.cold_rounds = 4, 1, 1
    counts = (args.rounds, args.batches, args.max_tokens, args.cold_rounds)
    if min(counts) < 1 or min(args.concurrency) < 1:
        parser.error(
            "--rounds, --batches, --max-tokens, --cold-rounds and --concurrency must be >= 1"
        )
    if args.alternations < 0 or args.pairs < 0 or args.alternations + args.pairs == 0:
        parser.error("--alternations and --pairs must be >= 0, one of them > 0")
    return args


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# -- processes -------------------------------------------------------------------------------------


def start_front_door(base: Path, name: str, args: Sequence[str], config: str = "") -> ServeProcess:
    """A ``vqpool serve ARGS`` on a run directory of its own under ``base``, serving."""
    if config:
        config_path = base / f"{name}.toml"
        config_path.write_text(config)
        args = [*args, "--config", str(config_path)]
    front = ServeProcess(base / name, base / f"{name}.log", ["--log-level", "WARNING", *args])
    try:
        return front.start()
    except BaseException:
        if front.process is not None:
            front.stop()
        raise


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` itself (not its children)."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


# -- requests --------------------------------------------------------------------------------------


@dataclass
class Stream:
    """One streamed completion, timed client side from when it was sent."""

    ttft: float
    tokens: int
    text: str


def stream_completion(url: str, body: dict[str, Any]) -> Stream:
    """Stream ``body`` to ``url``'s ``/v1/completions``; raises on anything but a whole answer."""
    sent = time.perf_counter()
    first: float | None = None
    pieces: list[str] = []
    usage: dict[str, int] | None = None
    request = {**body, "stream_options": {"include_usage": True}}
    for event in stream_events(url, "/v1/completions", request, timeout=REQUEST_TIMEOUT):
        if "error" in event:
            raise RuntimeError(f"{url}: the stream ended with an error: {event['error']}")
        for choice in event.get("choices") or []:
            if choice.get("text"):
                first = first or time.perf_counter()
                pieces.append(choice["text"])
        usage = event.get("usage") or usage
    if usage is None:
        raise RuntimeError(f"{url}: the stream carried no usage")
    ttft = (first or time.perf_counter()) - sent
    return Stream(ttft=ttft, tokens=usage["completion_tokens"], text="".join(pieces))


def prompt(seed: int, words: int = 24) -> str:
    """A prompt of ``words`` words, different for each seed (from its first word on)."""
    vocabulary = _WORDS_TEXT.split()
    n = len(vocabulary)
    return " ".join(vocabulary[(seed * 7 + i * (1 + seed % 5)) % n] for i in range(words))


def completion_body(model: str, seed: int, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt(seed), "max_tokens": max_tokens, "temperature": 0}


# -- 1. overhead -----------------------------------------------------------------------------------


def run_batch(url: str, bodies: list[dict[str, Any]]) -> tuple[list[Stream], float]:
    """Stream ``bodies`` at once; the streams and the wall time from the first sent to the last
    ended."""
    with ThreadPoolExecutor(len(bodies)) as pool:
        started = time.perf_counter()
        streams = list(pool.map(lambda body: stream_completion(url, body), bodies))
        return streams, time.perf_counter() - started


@dataclass
class PathRound:
    """One path's requests of one round."""

    streams: list[Stream] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.streams)

    @property
    def ttft_p50(self) -> float:
        return percentile([s.ttft for s in self.streams], 0.5)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def interleaved(first: str, second: str, n: int) -> list[str]:
    """``n`` turns each, A B B A A B B A ...: a drift that is linear within a round costs both
    paths the same."""
    return [(first, second, second, first)[i % 4] for i in range(2 * n)]


def measure_overhead(args: argparse.Namespace, base: Path) -> dict[str, Any]:
    model = args.model[0]
    # Prompt cache off: the same prompts go through both paths, and must cost the same twice.
    config = (
        f'[models."{model}"]\npath = "{model}"\nprompt_cache_bytes = 0\n'
        f"max_concurrent = {max(args.concurrency)}\n"
    )
    front = start_front_door(base, "overhead", [], config)
    result: dict[str, Any] = {"model": model, "concurrency": {}}
    try:
        row = front.control().load(model, wait=LOAD_TIMEOUT)
        paths = {"front door": front.url, "worker": row["url"]}
        progress(f"overhead: {model}, front door {front.url}, its worker {row['url']}")
        for url in paths.values():
            run_batch(url, [completion_body(model, -1, 8)])
        cpu_before = {"front door": cpu_seconds(front.pid), "worker": cpu_seconds(row["pid"])}
        tokens = {"front door": 0, "worker": 0}
        for c in args.concurrency:
            rounds: list[dict[str, PathRound]] = []
            for round_no in range(args.rounds):
                got = {kind: PathRound() for kind in paths}
                kinds = list(paths) if round_no % 2 == 0 else list(reversed(paths))
                turns = interleaved(kinds[0], kinds[1], args.batches)
                seen = dict.fromkeys(paths, 0)
                for kind in turns:
                    # The i-th batch of each path sends the same requests.
                    seed = 100_000 * c + 1000 * round_no + 10 * seen[kind]
                    seen[kind] += 1
                    bodies = [completion_body(model, seed + i, args.max_tokens) for i in range(c)]
                    streams, seconds = run_batch(paths[kind], bodies)
                    got[kind].streams += streams
                    got[kind].seconds += seconds
                for kind in paths:
                    tokens[kind] += got[kind].tokens
                rounds.append(got)
                front_r, worker_r = got["front door"], got["worker"]
                progress(
                    f"  c={c} round {round_no + 1}: TTFT p50 {1000 * front_r.ttft_p50:.1f} vs "
                    f"{1000 * worker_r.ttft_p50:.1f} ms, {front_r.tokens_per_s:.0f} vs "
                    f"{worker_r.tokens_per_s:.0f} tok/s (front door vs worker)"
                )
            result["concurrency"][str(c)] = {
                "ttft_p50_ms": {
                    kind: spread([1000 * r[kind].ttft_p50 for r in rounds]) for kind in paths
                },
                "ttft_delta_ms": spread(
                    [1000 * (r["front door"].ttft_p50 - r["worker"].ttft_p50) for r in rounds]
                ),
                "tokens_per_s": {
                    kind: spread([r[kind].tokens_per_s for r in rounds]) for kind in paths
                },
                "tokens_per_s_ratio": spread(
                    [r["front door"].tokens_per_s / r["worker"].tokens_per_s for r in rounds]
                ),
            }
        front_cpu = cpu_seconds(front.pid) - cpu_before["front door"]
        worker_cpu = cpu_seconds(row["pid"]) - cpu_before["worker"]
        generated = tokens["front door"] + tokens["worker"]
        result["cpu"] = {
            "front_door_us_per_token": 1e6 * front_cpu / tokens["front door"],
            "worker_us_per_token": 1e6 * worker_cpu / generated,
            "tokens_proxied": tokens["front door"],
            "tokens_generated": generated,
        }
    finally:
        result["exit_status"] = front.stop()
    return result


# -- 2. two models, --max-loaded 1 ---------------------------------------------------------------


def editor_sequence(models: list[str], alternations: int, pairs: int) -> list[list[str]]:
    """Steps of requests sent at once: A, B, A ... one at a time, then pairs [A, B]."""
    steps = [[models[i % 2]] for i in range(alternations)]
    return steps + [list(models) for _ in range(pairs)]


def fewest_loads(steps: list[list[str]], loaded: str | None) -> int:
    """The fewest loads that serving ``steps`` in order forces with one model loaded at a time,
    ``loaded`` loaded at the start: within a step sent at once the loaded model is served
    first, then the other one is loaded (one load, and it stays loaded for the next step)."""
    loads = 0
    for step in steps:
        wanted = set(step)
        if loaded in wanted:
            wanted.discard(loaded)
        loads += len(wanted)
        if wanted:
            loaded = step[-1] if step[-1] in wanted else next(iter(wanted))
    return loads


@dataclass
class Tally:
    failed: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def measure_two_models(args: argparse.Namespace, base: Path) -> dict[str, Any]:
    models = list(args.model)
    model_args = [arg for model in models for arg in ("--model", model)]
    front = start_front_door(base, "twomodels", [*model_args, "--max-loaded", "1"])
    steps = editor_sequence(models, args.alternations, args.pairs)
    bodies = [
        [completion_body(model, 500 + 10 * i + j, args.max_tokens) for j, model in enumerate(step)]
        for i, step in enumerate(steps)
    ]
    result: dict[str, Any] = {"models": models, "requests": sum(len(s) for s in steps)}
    try:
        # The reference: each model alone, loaded by hand, its requests straight to its worker.
        alone: dict[tuple[int, int], str] = {}
        for model in models:
            url = front.control().load(model, wait=LOAD_TIMEOUT)["url"]
            for i, step in enumerate(bodies):
                for j, body in enumerate(step):
                    if body["model"] == model:
                        alone[(i, j)] = stream_completion(url, body).text
        rows = front.rows()
        loads_before = sum(r["loads"] for r in rows.values())
        loaded = next((n for n, r in rows.items() if r["state"] == "loaded"), None)
        progress(f"two models, --max-loaded 1: {len(steps)} steps, {loaded} loaded at the start")
        tally = Tally()
        texts: dict[tuple[int, int], str] = {}

        def send(i: int, j: int, body: dict[str, Any]) -> None:
            try:
                texts[(i, j)] = stream_completion(front.url, body).text
            except (HttpStatusError, RuntimeError, OSError) as exc:
                with tally.lock:
                    tally.failed.append(f"{body['model']}: {exc}")

        started = time.perf_counter()
        for i, step in enumerate(bodies):
            threads = [
                threading.Thread(target=send, args=(i, j, body)) for j, body in enumerate(step)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        elapsed = time.perf_counter() - started
        rows = front.rows()
        different = sorted(k for k, text in texts.items() if text != alone[k])
        result.update(
            {
                "failed": len(tally.failed),
                "failures": tally.failed[:5],
                "loads": sum(r["loads"] for r in rows.values()) - loads_before,
                "fewest_loads": fewest_loads(steps, loaded),
                "identical": len(texts) - len(different),
                "compared": len(texts),
                "seconds": elapsed,
                "unloads": {n: r["unloads"] for n, r in rows.items()},
            }
        )
    finally:
        result["exit_status"] = front.stop()
    return result


# -- 3. cold start ---------------------------------------------------------------------------------


def first_token_after(start: Callable[[], str], body: dict[str, Any]) -> tuple[float, float]:
    """Seconds from calling ``start`` (which returns the URL once it answers) to it answering,
    and to the first token of ``body`` sent then."""
    started = time.perf_counter()
    url = start()
    answering = time.perf_counter() - started
    return answering, answering + stream_completion(url, body).ttft


def wait_answering(server: MlxLmServer) -> str:
    """``server``'s URL once its ``/health`` answers 200 (asked every 20 ms, as the front door's
    ready line is read as soon as it comes)."""
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"mlx_lm.server exited:\n{server.log_path.read_text()[-4000:]}")
        try:
            if request_json(server.url, "GET", "/health", timeout=2.0).status == 200:
                return server.url
        except OSError:
            pass
        time.sleep(0.02)
    raise RuntimeError(f"mlx_lm.server did not answer within {READY_TIMEOUT:.0f} s")


def measure_cold_start(args: argparse.Namespace, base: Path) -> dict[str, Any]:
    model_dir = Path(args.model[0])
    if not model_dir.is_dir():
        model_dir = write_model_dir(base / "cold-llama", "llama")
    model = str(model_dir)
    body = completion_body(model, 900, args.max_tokens)
    figures: dict[str, list[float]] = {
        "front_door_up_s": [],
        "front_door_first_token_s": [],
        "front_door_request_to_first_token_s": [],
        "mlx_lm_server_up_s": [],
        "mlx_lm_server_first_token_s": [],
        "mlx_lm_server_request_to_first_token_s": [],
    }
    statuses = []
    progress(f"cold start: {model}")
    for round_no in range(args.cold_rounds):
        kinds = ["front_door", "mlx_lm_server"]
        for kind in kinds if round_no % 2 == 0 else reversed(kinds):
            if kind == "front_door":
                fronts: list[ServeProcess] = []

                def start_front(
                    name: str = f"cold{round_no}", started: list[ServeProcess] = fronts
                ) -> str:
                    started.append(start_front_door(base, name, ["--model", model]))
                    return started[0].url

                try:
                    up, first = first_token_after(start_front, body)
                finally:
                    statuses += [front.stop() for front in fronts]
            else:
                servers: list[MlxLmServer] = []

                def start_mlx(
                    log: Path = base / f"mlx-{round_no}.log", started: list[MlxLmServer] = servers
                ) -> str:
                    started.append(MlxLmServer(model_dir, log))
                    return wait_answering(started[0])

                try:
                    up, first = first_token_after(start_mlx, body)
                finally:
                    for server in servers:
                        server.stop()
            figures[f"{kind}_up_s"].append(up)
            figures[f"{kind}_first_token_s"].append(first)
            figures[f"{kind}_request_to_first_token_s"].append(first - up)
            progress(f"  round {round_no + 1} {kind}: up {up:.2f} s, first token {first:.2f} s")
    result: dict[str, Any] = {"model_dir": model, "rounds": args.cold_rounds}
    result.update({name: spread(values) for name, values in figures.items()})
    result["exit_statuses"] = statuses
    return result


# -- report ----------------------------------------------------------------------------------------


def _with_spread(figure: dict[str, float], fmt: str) -> str:
    return f"{figure['median']:{fmt}} ({figure['min']:{fmt}} to {figure['max']:{fmt}})"


def print_report(results: dict[str, Any], args: argparse.Namespace) -> None:
    overhead = results["overhead"]
    print(
        f"\n## Overhead: {overhead['model']}, front door vs its worker straight, same worker "
        f"process, streaming, {args.max_tokens} tokens per request, {args.batches} "
        f"batches per path and round, {args.rounds} rounds (median, min to max of rounds)\n"
    )
    print(
        "| concurrency | TTFT p50 worker (ms) | TTFT p50 front door (ms) | TTFT delta (ms) "
        "| worker tok/s | front door tok/s | tok/s ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for c, r in overhead["concurrency"].items():
        print(
            f"| {c} | {r['ttft_p50_ms']['worker']['median']:.1f} "
            f"| {r['ttft_p50_ms']['front door']['median']:.1f} "
            f"| {_with_spread(r['ttft_delta_ms'], '+.1f')} "
            f"| {r['tokens_per_s']['worker']['median']:.0f} "
            f"| {r['tokens_per_s']['front door']['median']:.0f} "
            f"| {_with_spread(r['tokens_per_s_ratio'], '.3f')}x |"
        )
    cpu = overhead["cpu"]
    print(
        f"\nCPU per token: front door {cpu['front_door_us_per_token']:.0f} us per proxied token "
        f"({cpu['tokens_proxied']} tokens), worker {cpu['worker_us_per_token']:.0f} us per "
        f"generated token ({cpu['tokens_generated']} tokens); front door / worker "
        f"{cpu['front_door_us_per_token'] / cpu['worker_us_per_token']:.3f}"
    )
    two = results["two_models"]
    print(
        f"\n## Two models that do not fit together: {' and '.join(two['models'])}, "
        f"--max-loaded 1, {args.alternations} alternating requests then {args.pairs} pairs "
        "sent at once\n"
    )
    print("| requests | failed | loads | fewest loads forced | responses identical to alone | s |")
    print("|---|---|---|---|---|---|")
    print(
        f"| {two['requests']} | {two['failed']} | {two['loads']} | {two['fewest_loads']} "
        f"| {two['identical']}/{two['compared']} | {two['seconds']:.1f} |"
    )
    for failure in two["failures"]:
        print(f"FAILED: {failure}")
    cold = results["cold_start"]
    print(
        f"\n## Cold start: {cold['model_dir']}, {cold['rounds']} round(s) "
        "(median, min to max), seconds\n"
    )
    print("| server | process start to answering | to first token | request to first token |")
    print("|---|---|---|---|")
    for kind, label in (("front_door", "vqpool serve"), ("mlx_lm_server", "mlx_lm.server")):
        print(
            f"| {label} | {_with_spread(cold[f'{kind}_up_s'], '.2f')} "
            f"| {_with_spread(cold[f'{kind}_first_token_s'], '.2f')} "
            f"| {_with_spread(cold[f'{kind}_request_to_first_token_s'], '.2f')} |"
        )
    statuses = [overhead["exit_status"], two["exit_status"], *cold["exit_statuses"]]
    print(f"\nvqpool serve exit statuses on SIGTERM: {sorted(set(statuses))}")
    print(f"load average {results['load_average']} (2 vCPUs shared: read ratios, not absolutes)")


def main() -> int:
    args = parse_args()
    base = Path(tempfile.mkdtemp(prefix="vqfd", dir="/tmp"))  # short: sockets live under it
    try:
        results = {
            "overhead": measure_overhead(args, base),
            "two_models": measure_two_models(args, base),
            "cold_start": measure_cold_start(args, base),
            "load_average": "/".join(f"{x:.1f}" for x in os.getloadavg()),
        }
        if args.json:
            print(json.dumps(results, indent=2))
        else:
            print_report(results, args)
        two = results["two_models"]
        statuses = [results["overhead"]["exit_status"], two["exit_status"]]
        statuses += results["cold_start"]["exit_statuses"]
        return 0 if two["failed"] == 0 and not any(statuses) else 1
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
