#!/usr/bin/env python3
"""Several models under one memory budget, loaded and unloaded by three policies, through one
``vqpool serve`` (issue 25's benchmark).

Four test-written llama directories of different sizes (random fp32 weights, 17 to 88 MB; see
``MODELS``) and a budget that holds about two of them with their KV: the weights plus the fixed
KV of the two largest, so that the count cap below never goes over it. One seeded trace: per
model, multi-turn chats that start as Poisson arrivals, skewed across the models (one takes
most of them) and bursty for one model (its rate multiplied for a few seconds, then quiet);
each turn is a streamed ``/v1/chat/completions`` with the history so far, sent when the
previous answer ended plus a think time. The same trace is played, in the same run, under:

- ``ledger`` (a): vqpool's byte ledger: no count cap; the front door loads a model when its
  weights and its KV minimum fit in the budget and unloads idle models by bytes; KV grows on
  demand (``--reserve on-demand``). Needs the front door that loads by bytes (issue 25); on a
  front door without it the policy is skipped unless asked by ``--policies`` (then it runs as
  "no cap", weights uncharged, and says so).
- ``count`` (b): ``--max-loaded 2``, least recently used idle model unloaded, every model's KV
  fixed at ``SLOTS x CONTEXT`` tokens (its ``limit``) and reserved whole per request
  (``--reserve full``): what Ollama does with ``OLLAMA_MAX_LOADED_MODELS`` and ``num_ctx``.
- ``swap`` (c): ``--max-loaded 1``, a model's KV limited to what its weights leave of the
  budget, reserved whole: one model at a time, swapped on demand (llama-swap's default).

Per policy: requests completed and failed, time to first token p50 and p99 per model (client
side, from sending, load waits included; pooled over rounds, with the per-round p99 spread),
loads and unloads (the front door's rows, by reason), the most models loaded at once, and
memory: the resident set of every process of the ``vqpool serve`` tree (the front door,
vqpoold, the workers) sampled every 100 ms, against the budget; also that peak less the
runtime's own floor (each process's RSS with no model in it: Python, MLX, the libraries,
measured at the start), which is what the budget is meant to bound; and the ledger's
declared peak (KV held, plus the weights it charges). And where the TTFTs went: each
response's ``X-Vqpool-Load-Wait`` (of that ``-Memory-Wait``, of that ``-Residency-Wait``) split
from the worker's part (queue and prefill), summed per policy, and the slowest requests one by
one with their prompt and cached tokens.

Noisy neighbour: a batch job on one model (64 clients, each sending a long request again as
soon as its last one ends: unbounded demand, KV growing on demand) beside an interactive chat
model, both loaded, in a pool whose KV room the batch alone can fill; the chat model's p99 TTFT
with a reserve (``reserve``, and the same with ``lend_reserves``) against the same pool
without reserves (``shared``). Both models are the small test directories (``model_dirs``'s
llama and qwen3), so that the two cores go to the requests, not to the weights.

Rounds alternate the order of the policies (a b c, c b a, ...) so that the drift of a shared
machine falls on all of them alike. On 2 shared vCPUs read the policies against each other.

    .venv/bin/python scripts/bench_models.py                 # 8 to 11 min on 2 shared vCPUs
    .venv/bin/python scripts/bench_models.py --quick         # a smoke run, 2 to 3 min
    .venv/bin/python scripts/bench_models.py --policies count,swap --no-noisy
    .venv/bin/python scripts/bench_models.py --models-dir /tmp/bm-models   # keep the models
    .venv/bin/python scripts/bench_models.py --json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_front_door import spread, start_front_door
from vqpool.daemon.front.load_wait import (
    LOAD_WAIT_HEADER,
    MEMORY_WAIT_HEADER,
    RESIDENCY_WAIT_HEADER,
)
from vqpool.shared.admin_client import AdminClient
from vqpool.shared.byte_sizes import format_bytes
from vqpool.shared.errors import VqpoolError
from vqpool.shared.model_weights import estimate_weights, serve_cache_limit, worker_overhead
from vqpool.worker.testing.http_client import HttpStatusError, stream_events
from vqpool.worker.testing.launch import ServeProcess
from vqpool.worker.testing.model_dirs import write_config_dir, write_model_dir

MiB = 1 << 20
REQUEST_TIMEOUT = 300.0
LOAD_TIMEOUT = 300.0
SAMPLE_EVERY = 0.1
"""Seconds between two samples of the process tree's resident set."""
WORKER_STATES = ("loading", "loaded", "unloading")
"""Front-door row states in which the model's worker process exists."""
ROWS_EVERY = 0.25
"""Seconds between two samples of the front door's rows and the ledger."""

SLOTS = 4
"""Requests a worker decodes at once (every policy), Ollama's OLLAMA_NUM_PARALLEL."""
CONTEXT = 512
"""Tokens of KV per slot in the count cap's fixed KV (Ollama's num_ctx)."""


@dataclass(frozen=True)
class ModelSpec:
    """One model of the trace: its shape and its traffic.

    Attributes:
        name: Served name.
        hidden, layers, intermediate, heads, kv_heads: The llama config (head dim 64).
        rate: Chats started per second (mean, outside bursts).
        burst: Rate multiplier during a burst (1: no bursts).
    """

    name: str
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    rate: float
    burst: float = 1.0

    def config(self) -> dict[str, Any]:
        return {
            "model_type": "llama",
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "intermediate_size": self.intermediate,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
        }

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, fp32."""
        return self.layers * self.kv_heads * (self.hidden // self.heads) * 2 * 4


MODELS = (
    ModelSpec("s", 256, 4, 1024, 4, 2, rate=0.08),  # ~17 MB of weights, 4 KiB of KV per token
    ModelSpec("m", 256, 8, 1024, 4, 2, rate=0.14, burst=4.0),  # ~33 MB, 8 KiB
    ModelSpec("l", 384, 6, 1536, 6, 2, rate=0.05),  # ~54 MB, 6 KiB
    ModelSpec("xl", 384, 10, 1536, 6, 2, rate=0.04),  # ~88 MB, 10 KiB
)
BURST_ON, BURST_OFF = 6.0, 14.0
"""A bursty model's bursts: this many seconds at ``burst`` x its rate, then this many quiet."""
TURNS = (1, 4)
THINK_MEAN = 1.5
"""Mean seconds between an answer and the next turn of its chat (exponential)."""
USER_WORDS = (10, 30)
REPLY_TOKENS = (16, 32)

NOISY_ROOM = 8 * MiB
"""KV bytes of the noisy-neighbour pool: the batch's demand is several times this."""
NOISY_RESERVE = 2 * MiB
"""The chat model's reserve in the noisy-neighbour pool."""
NOISY_CLIENTS = 64
NOISY_PROMPT, NOISY_OUTPUT = 384, 384
"""Tokens of a batch request's prompt and answer (about 1,000 x 512 bytes of KV of the tiny
llama at the end, 64 of them: 48 MiB of demand against 8 MiB of room)."""
NOISY_CHAT_RATE = 0.6
NOISY_SYSTEM_WORDS = 300
"""Words of the chat's system prompt (an assistant's instructions): a few hundred tokens, so a
chat request needs tens of blocks, not one."""

_WORDS_TEXT = (
    "a key value cache keeps the keys and values of every token the model has seen so that "
    "each new one attends to the past without computing it again two models on one machine "
    "share a pool the daemon hands out ids and takes them back when a request ends hello how "
    "are you say hello in five words why share one pool the quick brown fox jumps over the "
    "lazy dog"
)
_WORDS = _WORDS_TEXT.split(" ")


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--policies", default=None,
        help="comma-separated, of ledger, count, swap, ledger-no-gap (default: ledger, count "
        "and swap when the front door loads by bytes, else count and swap)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2, help="rounds per policy (default: 2)")
    parser.add_argument(
        "--duration", type=float, default=30.0,
        help="seconds during which chats start, per round (default: 30)",
    )  # fmt: skip
    parser.add_argument(
        "--noisy-duration", type=float, default=25.0,
        help="seconds of chat beside the batch job, per variant (default: 25)",
    )  # fmt: skip
    parser.add_argument("--no-noisy", action="store_true", help="skip the noisy neighbour")
    parser.add_argument("--seed", type=int, default=1, help="trace seed (default: 1)")
    parser.add_argument(
        "--models-dir", type=Path,
        help="write (or reuse) the model directories here and keep them (default: a "
        "temporary directory)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument(
        "--quick", action="store_true",
        help="a smoke run: 1 round of 15 s, 10 s of noisy neighbour per variant",
    )  # fmt: skip
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.duration, args.noisy_duration = 1, 15.0, 10.0
    if args.rounds < 1 or args.duration <= 0 or args.noisy_duration <= 0:
        parser.error("--rounds must be >= 1, --duration and --noisy-duration > 0")
    if args.policies is None:
        args.policies = ["ledger", "count", "swap"] if LOADS_BY_BYTES else ["count", "swap"]
    else:
        args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        unknown = sorted(set(args.policies) - set(POLICY_LABELS))
        if unknown or not args.policies:
            parser.error(f"--policies: unknown {unknown}; choose of {', '.join(POLICY_LABELS)}")
    return args


def _front_door_loads_by_bytes() -> bool:
    """Whether this front door loads models by bytes (issue 25's ``--min-residency``, the
    ledger's load reservations) rather than by count only."""
    help_text = subprocess.run(
        [sys.executable, "-m", "vqpool.daemon.front", "serve", "--help"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return "--min-residency" in help_text


LOADS_BY_BYTES = _front_door_loads_by_bytes()


# -- models ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Model:
    spec: ModelSpec
    path: Path
    weights: int

    @property
    def overhead(self) -> int:
        """What the front door charges beside its weights: its worker's MLX buffer-cache limit
        and the runtime's growth."""
        return worker_overhead(serve_cache_limit(self.weights))

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def fixed_kv(self) -> int:
        """The count cap's fixed KV: ``SLOTS`` slots of ``CONTEXT`` tokens."""
        return SLOTS * CONTEXT * self.spec.kv_bytes_per_token


def write_models(base: Path) -> list[Model]:
    """The four model directories under ``base``, written unless already there with the same
    config."""
    models = []
    for spec in MODELS:
        path = base / spec.name
        config_path = path / "config.json"
        same = False
        if config_path.exists() and (path / "model.safetensors").exists():
            written = json.loads(config_path.read_text())
            same = all(written.get(k) == v for k, v in spec.config().items())
        if not same:
            progress(f"writing model {spec.name} to {path}")
            write_config_dir(path, spec.config(), seed=MODELS.index(spec))
        estimate = estimate_weights(str(path))
        assert estimate is not None, path
        models.append(Model(spec, path, estimate.nbytes))
    return models


def budget_for(models: Sequence[Model]) -> int:
    """Weights, overhead and fixed KV of the two largest models: what the count cap of 2 needs
    at most."""
    costs = sorted((m.weights + m.overhead + m.fixed_kv for m in models), reverse=True)
    return costs[0] + costs[1]


# -- the trace -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chat:
    """One multi-turn chat: when it starts, its model, its user turns and think times."""

    cid: int
    start: float
    model: str
    turns: tuple[str, ...]
    max_tokens: tuple[int, ...]
    thinks: tuple[float, ...]
    system: str = ""


def rate_at(spec: ModelSpec, t: float) -> float:
    if spec.burst == 1.0:
        return spec.rate
    # Bursts and quiet alternate; the mean over a cycle stays the rate.
    cycle = BURST_ON + BURST_OFF
    high = spec.rate * spec.burst
    low = max(0.0, (spec.rate * cycle - high * BURST_ON) / BURST_OFF)
    return high if (t % cycle) < BURST_ON else low


def make_trace(duration: float, seed: int) -> list[Chat]:
    """Chats starting within ``duration`` seconds, Poisson per model (thinned for bursts)."""
    chats: list[Chat] = []
    for index, spec in enumerate(MODELS):
        rng = random.Random(1000 * seed + index)  # a model's chats do not depend on the others'
        peak = spec.rate * spec.burst
        t = 0.0
        while True:
            t += rng.expovariate(peak)
            if t >= duration:
                break
            if rng.random() * peak > rate_at(spec, t):
                continue
            n = rng.randint(*TURNS)
            turns = tuple(
                " ".join(rng.choice(_WORDS) for _ in range(rng.randint(*USER_WORDS)))
                for _ in range(n)
            )
            chats.append(
                Chat(
                    cid=0,
                    start=t,
                    model=spec.name,
                    turns=turns,
                    max_tokens=tuple(rng.randint(*REPLY_TOKENS) for _ in range(n)),
                    thinks=tuple(rng.expovariate(1 / THINK_MEAN) for _ in range(n)),
                )
            )
    chats.sort(key=lambda c: c.start)
    return [Chat(i, c.start, c.model, c.turns, c.max_tokens, c.thinks) for i, c in enumerate(chats)]


# -- requests --------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One request: its TTFT or error, and where its TTFT went: the front door's wait for its
    model's load (its headers: of that, the load's wait for memory, and of that, the time only
    models inside ``--min-residency`` could have made room), the rest being the worker's
    (its queue, the prefill of the ``prompt_tokens`` less the ``cached_tokens`` its prompt
    cache gave)."""

    model: str
    ttft: float | None = None
    error: str | None = None
    load_wait: float = 0.0
    memory_wait: float = 0.0
    residency_wait: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def worker_time(self) -> float:
        return max(0.0, (self.ttft or 0.0) - self.load_wait)


def stream_chat(url: str, body: dict[str, Any], outcome: Outcome) -> str:
    """Stream one chat completion; its answer text. Sets ``outcome``'s TTFT (the first piece
    of content, else the end) or its error."""
    sent = time.perf_counter()
    pieces: list[str] = []
    headers: dict[str, str] = {}
    body = {**body, "stream_options": {"include_usage": True}}
    try:
        events = stream_events(
            url, "/v1/chat/completions", body, timeout=REQUEST_TIMEOUT, headers_out=headers
        )
        for event in events:
            if "error" in event:
                raise RuntimeError(f"the stream ended with an error: {event['error']}")
            usage = event.get("usage")
            if usage:
                outcome.prompt_tokens = usage.get("prompt_tokens", 0)
                details = usage.get("prompt_tokens_details") or {}
                outcome.cached_tokens = details.get("cached_tokens", 0)
            for choice in event.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    if outcome.ttft is None:
                        outcome.ttft = time.perf_counter() - sent
                    pieces.append(text)
        if outcome.ttft is None:
            outcome.ttft = time.perf_counter() - sent
        outcome.load_wait = float(headers.get(LOAD_WAIT_HEADER.lower(), 0.0))
        outcome.memory_wait = float(headers.get(MEMORY_WAIT_HEADER.lower(), 0.0))
        outcome.residency_wait = float(headers.get(RESIDENCY_WAIT_HEADER.lower(), 0.0))
    except (HttpStatusError, RuntimeError, OSError) as exc:
        outcome.ttft = None
        outcome.error = str(exc)[:300]
    return "".join(pieces)


def play_chat(
    url: str, chat: Chat, t0: float, outcomes: list[Outcome], lock: threading.Lock
) -> None:
    """Play ``chat``'s turns from ``t0`` + its start, each after the last answer and a think."""
    delay = t0 + chat.start - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
    messages = [{"role": "system", "content": chat.system}] if chat.system else []
    for turn, max_tokens, think in zip(chat.turns, chat.max_tokens, chat.thinks, strict=True):
        messages.append({"role": "user", "content": turn})
        outcome = Outcome(chat.model)
        body = {
            "model": chat.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        reply = stream_chat(url, body, outcome)
        with lock:
            outcomes.append(outcome)
        # A failed turn still leaves the chat going, so every policy sends the same requests.
        messages.append({"role": "assistant", "content": reply or "..."})
        time.sleep(think)


# -- memory ----------------------------------------------------------------------------------------


def tree_rss(root: int) -> tuple[int, int]:
    """Resident bytes of process ``root`` and all its descendants, and how many processes."""
    try:
        parent = psutil.Process(root)
        procs = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    total = 0
    counted = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
            counted += 1
        except psutil.NoSuchProcess:
            pass
    return total, counted


@dataclass
class Floors:
    """RSS of the runtime with no model in it: the front door and vqpoold, and one worker."""

    front_and_daemon: int
    worker: int


class Sampler(threading.Thread):
    """Samples the serve tree's RSS, the models loaded and the ledger's declared bytes until
    stopped; keeps the peaks."""

    def __init__(self, front: ServeProcess, floors: Floors | None) -> None:
        super().__init__(daemon=True)
        self.front = front
        self.floors = floors
        self.halt = threading.Event()
        self.peak_rss = 0
        self.peak_above_floor = 0
        self.peak_loaded = 0
        self.peak_declared = 0

    def run(self) -> None:
        last_rows = 0.0
        admin = None
        try:
            while not self.halt.is_set():
                now = time.monotonic()
                if now - last_rows >= ROWS_EVERY:
                    last_rows = now
                    admin = self._sample_rows(admin)
                rss, n = tree_rss(self.front.pid)
                self.peak_rss = max(self.peak_rss, rss)
                if self.floors is not None and n >= 2:
                    workers = n - 2
                    floor = self.floors.front_and_daemon + workers * self.floors.worker
                    self.peak_above_floor = max(self.peak_above_floor, rss - floor)
                self.halt.wait(SAMPLE_EVERY)
        finally:
            if admin is not None:
                admin.close()

    def _sample_rows(self, admin: AdminClient | None) -> AdminClient | None:
        try:
            rows = self.front.rows()
        except (VqpoolError, OSError):
            return admin
        # A worker exists (starting, serving or stopping): a load waiting for memory has none.
        loaded = [r for r in rows.values() if r["state"] in WORKER_STATES]
        self.peak_loaded = max(self.peak_loaded, len(loaded))
        try:
            admin = admin or AdminClient(self.front.run_dir, timeout=2.0)
            budget = admin.call("budget")
        except VqpoolError:
            return None
        # The ledger's own total of weights when it charges them, else the rows' weights.
        weights = budget.get("total_weights")
        if weights is None:
            weights = sum(r["weights_bytes"] or 0 for r in loaded)
        weights += budget.get("total_overhead", 0)
        self.peak_declared = max(self.peak_declared, budget["total_held"] + weights)
        return admin


def measure_floors(base: Path) -> Floors:
    """The runtime's RSS with no model in it: ``vqpool serve`` and its vqpoold before any
    load, then one worker of the smallest test model (a few hundred KiB of weights)."""
    tiny = write_model_dir(base / "floor-llama", "llama")
    front = start_front_door(base, "floor", ["--model", str(tiny), "--budget", "64MiB"])
    try:
        time.sleep(1.0)  # the daemon's and the front door's imports settle
        front_and_daemon, _ = tree_rss(front.pid)
        row = front.control().load(str(tiny), wait=LOAD_TIMEOUT)
        body = {"model": str(tiny), "messages": [{"role": "user", "content": "hello"}]}
        stream_chat(front.url, {**body, "max_tokens": 8}, Outcome(str(tiny)))
        worker = psutil.Process(row["pid"]).memory_info().rss
    finally:
        front.stop()
    return Floors(front_and_daemon, worker)


# -- processes -------------------------------------------------------------------------------------


def policy_config(policy: str, models: Sequence[Model], budget: int) -> tuple[str, list[str]]:
    """The settings file and the options of ``vqpool serve`` for ``policy``."""
    lines = ['[serve]\nkeep_alive = "5m"']
    if policy == "ledger-no-gap":  # the ledger without its conversation rules, to weigh them
        lines.append("conversation_gap = 0")
    lines.append("")
    for model in models:
        lines.append(f'[models."{model.name}"]')
        lines.append(f'path = "{model.path}"')
        lines.append(f"max_concurrent = {SLOTS}")
        if policy.startswith("ledger"):
            lines.append('reserve_mode = "on-demand"')
        else:
            lines.append('reserve_mode = "full"')
            fixed = model.weights + model.overhead
            limit = model.fixed_kv if policy == "count" else budget - fixed
            lines.append(f'limit = "{limit}B"')
        lines.append("")
    options = ["--budget", f"{budget}B"]
    if policy == "count":
        options += ["--max-loaded", "2"]
    elif policy == "swap":
        options += ["--max-loaded", "1"]
    return "\n".join(lines), options


@dataclass
class RoundResult:
    outcomes: list[Outcome] = field(default_factory=list)
    loads: int = 0
    unloads: dict[str, int] = field(default_factory=dict)
    load_failures: int = 0
    crashes: int = 0
    peak_rss: int = 0
    peak_above_floor: int = 0
    peak_loaded: int = 0
    peak_declared: int = 0
    seconds: float = 0.0
    exit_status: int = 0


def play_round(
    policy: str,
    round_no: int,
    models: Sequence[Model],
    budget: int,
    trace: Sequence[Chat],
    base: Path,
    floors: Floors,
) -> RoundResult:
    config, options = policy_config(policy, models, budget)
    front = start_front_door(base, f"{policy}{round_no}", options, config)
    result = RoundResult()
    sampler = Sampler(front, floors)
    sampler.start()
    try:
        lock = threading.Lock()
        t0 = time.perf_counter()
        threads = [
            threading.Thread(target=play_chat, args=(front.url, chat, t0, result.outcomes, lock))
            for chat in trace
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        result.seconds = time.perf_counter() - t0
        for row in front.rows().values():
            result.loads += row["loads"]
            result.load_failures += row["load_failures"]
            result.crashes += row["crashes"]
            for reason, n in row["unloads"].items():
                result.unloads[reason] = result.unloads.get(reason, 0) + n
    finally:
        sampler.halt.set()
        sampler.join()
        result.exit_status = front.stop()
    result.peak_rss = sampler.peak_rss
    result.peak_above_floor = sampler.peak_above_floor
    result.peak_loaded = sampler.peak_loaded
    result.peak_declared = sampler.peak_declared
    return result


# -- figures ---------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values``, nearest rank; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summarize(rounds: Sequence[RoundResult], budget: int) -> dict[str, Any]:
    """A policy's figures: TTFTs pooled over its rounds, the rest summed or peaked, and the
    per-round spread of the p99 over all models."""
    outcomes = [o for r in rounds for o in r.outcomes]
    per_model: dict[str, Any] = {}
    for spec in MODELS:
        ttfts = [o.ttft for o in outcomes if o.model == spec.name and o.ttft is not None]
        per_model[spec.name] = {
            "requests": sum(1 for o in outcomes if o.model == spec.name),
            "ttft_p50_s": percentile(ttfts, 0.5),
            "ttft_p99_s": percentile(ttfts, 0.99),
        }
    unloads: dict[str, int] = {}
    for r in rounds:
        for reason, n in r.unloads.items():
            unloads[reason] = unloads.get(reason, 0) + n
    unloads.pop("shutdown", None)
    round_p99 = [
        percentile([o.ttft for o in r.outcomes if o.ttft is not None], 0.99) or 0.0 for r in rounds
    ]
    all_ttfts = [o.ttft for o in outcomes if o.ttft is not None]
    return {
        "breakdown": breakdown(outcomes),
        "rounds": len(rounds),
        "requests": len(outcomes),
        "completed": sum(1 for o in outcomes if o.error is None),
        "failed": sum(1 for o in outcomes if o.error is not None),
        "failures": sorted({o.error for o in outcomes if o.error})[:3],
        "ttft_p50_s": percentile(all_ttfts, 0.5),
        "ttft_p99_s": percentile(all_ttfts, 0.99),
        "ttft_p99_s_per_round": spread(round_p99),
        "models": per_model,
        "loads": sum(r.loads for r in rounds),
        "unloads": unloads,
        "load_failures": sum(r.load_failures for r in rounds),
        "crashes": sum(r.crashes for r in rounds),
        "peak_loaded": max(r.peak_loaded for r in rounds),
        "peak_rss": max(r.peak_rss for r in rounds),
        "peak_above_floor": max(r.peak_above_floor for r in rounds),
        "peak_declared": max(r.peak_declared for r in rounds),
        "budget": budget,
        "seconds": [round(r.seconds, 1) for r in rounds],
        "exit_statuses": [r.exit_status for r in rounds],
    }


TAIL = 5
"""The slowest requests of a policy whose TTFT the report splits one by one."""


def breakdown(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Where a policy's TTFTs went: how many requests waited for a load, the seconds of all
    of them spent waiting for loads (for memory, of that for models inside their residency)
    and in the workers, the p99 of the workers' part alone, and the slowest requests split."""
    done = [o for o in outcomes if o.ttft is not None]
    slowest = sorted(done, key=lambda o: o.ttft or 0.0, reverse=True)[:TAIL]
    return {
        "waited_for_load": sum(1 for o in done if o.load_wait > 0),
        "load_wait_s": sum(o.load_wait for o in done),
        "memory_wait_s": sum(o.memory_wait for o in done),
        "residency_wait_s": sum(o.residency_wait for o in done),
        "worker_s": sum(o.worker_time for o in done),
        "worker_p99_s": percentile([o.worker_time for o in done], 0.99),
        "slowest": [
            {
                "model": o.model,
                "ttft_s": o.ttft,
                "load_wait_s": o.load_wait,
                "memory_wait_s": o.memory_wait,
                "residency_wait_s": o.residency_wait,
                "worker_s": o.worker_time,
                "prompt_tokens": o.prompt_tokens,
                "cached_tokens": o.cached_tokens,
            }
            for o in slowest
        ],
    }


# -- noisy neighbour -------------------------------------------------------------------------------


class BatchJob:
    """``NOISY_CLIENTS`` clients each sending a long completion again as soon as its last one
    ends, until stopped (a stream is closed at the stop, which cancels it)."""

    def __init__(self, url: str, model: str) -> None:
        self.url = url
        self.model = model
        self.stop = threading.Event()
        self.tokens = 0
        self.completed = 0
        self.failed = 0
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True)
            for i in range(NOISY_CLIENTS)
        ]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def _client(self, client: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            prompt = [1 + (client * 7919 + n * 104729 + j * 31) % 400 for j in range(NOISY_PROMPT)]
            body = {
                "model": self.model,
                "prompt": prompt,
                "max_tokens": NOISY_OUTPUT,
                "temperature": 0,
                "stream_options": {"include_usage": True},
            }
            tokens = 0
            try:
                events = stream_events(self.url, "/v1/completions", body, timeout=REQUEST_TIMEOUT)
                for event in events:
                    if "error" in event:
                        raise RuntimeError(str(event["error"]))
                    for choice in event.get("choices") or []:
                        tokens += 1 if choice.get("text") else 0
                    if self.stop.is_set():
                        events.close()
                        break
                else:
                    with self.lock:
                        self.completed += 1
            except (HttpStatusError, RuntimeError, OSError) as exc:
                if not self.stop.is_set():
                    with self.lock:
                        self.failed += 1
                        self.errors.append(str(exc)[:200])
                    time.sleep(0.5)
            with self.lock:
                self.tokens += tokens

    def end(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(REQUEST_TIMEOUT)


def noisy_trace(duration: float, seed: int) -> list[Chat]:
    rng = random.Random(seed + 1)
    system = " ".join(rng.choice(_WORDS) for _ in range(NOISY_SYSTEM_WORDS))
    chats = []
    t = 0.0
    while True:
        t += rng.expovariate(NOISY_CHAT_RATE)
        if t >= duration:
            break
        n = rng.randint(*TURNS)
        turns = tuple(
            " ".join(rng.choice(_WORDS) for _ in range(rng.randint(*USER_WORDS))) for _ in range(n)
        )
        chats.append(
            Chat(
                len(chats),
                t,
                "chat",
                turns,
                tuple(rng.randint(*REPLY_TOKENS) for _ in range(n)),
                tuple(rng.expovariate(1 / THINK_MEAN) for _ in range(n)),
                system,
            )
        )
    return chats


def noisy_variant(
    variant: str, base: Path, batch_dir: Path, chat_dir: Path, trace: Sequence[Chat]
) -> dict[str, Any]:
    """The chat model's TTFTs beside the batch job, in the pool of ``variant``: ``reserve``,
    ``lend`` (reserve, lent while unused) or ``shared`` (no reserve)."""
    weights = 0
    if LOADS_BY_BYTES:  # the budget charges weights too: the same KV room after them
        for path in (batch_dir, chat_dir):
            estimate = estimate_weights(str(path))
            weights += 0 if estimate is None else estimate.nbytes
    lines = [
        "lend_reserves = true" if variant == "lend" else "",
        "[serve]\nkeep_alive = -1\nqueue_timeout = 300\n",
        '[models."batch"]',
        f'path = "{batch_dir}"',
        f"max_concurrent = {NOISY_CLIENTS}",
        f"max_queue = {2 * NOISY_CLIENTS}",
        "queue_timeout = 300",
        'reserve_mode = "on-demand"',
        "prompt_cache_bytes = 0",
        "",
        '[models."chat"]',
        f'path = "{chat_dir}"',
        f"max_concurrent = {SLOTS}",
        "queue_timeout = 300",
        'reserve_mode = "on-demand"',
    ]
    if variant != "shared":
        lines.append(f'reserve = "{NOISY_RESERVE}B"')
    front = start_front_door(
        base, f"noisy-{variant}", ["--budget", f"{NOISY_ROOM + weights}B"], "\n".join(lines) + "\n"
    )
    outcomes: list[Outcome] = []
    try:
        control = front.control()
        control.load("batch", wait=LOAD_TIMEOUT)
        control.load("chat", wait=LOAD_TIMEOUT)
        # Warm the chat model's first step, so that its first TTFT is not the runtime's warm-up.
        body = {"model": "chat", "messages": [{"role": "user", "content": "hello"}]}
        stream_chat(front.url, {**body, "max_tokens": 4}, Outcome("chat"))
        batch = BatchJob(front.url, "batch")
        batch.start()
        # The premise: the batch holds the pool's room (all of it but the chat's reserve).
        full_at = 0.8 * (NOISY_ROOM - (0 if variant == "shared" else NOISY_RESERVE))
        deadline = time.monotonic() + 60.0
        held = 0
        with AdminClient(front.run_dir, timeout=5.0) as admin:
            while time.monotonic() < deadline:
                held = admin.call("budget")["total_held"]
                if held >= full_at:
                    break
                time.sleep(0.1)
        progress(f"  noisy {variant}: batch holds {format_bytes(held)}, chats start")
        started = time.perf_counter()
        tokens_before = batch.tokens
        lock = threading.Lock()
        threads = [
            threading.Thread(target=play_chat, args=(front.url, chat, started, outcomes, lock))
            for chat in trace
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - started
        batch_tokens = batch.tokens - tokens_before
        batch.end()
    finally:
        status = front.stop()
    ttfts = [o.ttft for o in outcomes if o.ttft is not None]
    return {
        "variant": variant,
        "chat_requests": len(outcomes),
        "chat_failed": sum(1 for o in outcomes if o.error is not None),
        "chat_failures": sorted({o.error for o in outcomes if o.error})[:3],
        "chat_ttft_p50_s": percentile(ttfts, 0.5),
        "chat_ttft_p99_s": percentile(ttfts, 0.99),
        "batch_tokens_per_s": batch_tokens / seconds,
        "batch_completed": batch.completed,
        "batch_failed": batch.failed,
        "batch_failures": batch.errors[:3],
        "exit_status": status,
    }


def measure_noisy(args: argparse.Namespace, base: Path) -> dict[str, Any]:
    batch_dir = write_model_dir(base / "noisy-llama", "llama")
    chat_dir = write_model_dir(base / "noisy-qwen3", "qwen3")
    trace = noisy_trace(args.noisy_duration, args.seed)
    progress(
        f"noisy neighbour: batch {NOISY_CLIENTS} clients x ({NOISY_PROMPT} + {NOISY_OUTPUT} "
        f"tokens), {len(trace)} chats, KV room {format_bytes(NOISY_ROOM)}"
    )
    return {
        "kv_room": NOISY_ROOM,
        "reserve": NOISY_RESERVE,
        "chats": len(trace),
        "variants": [
            noisy_variant(variant, base, batch_dir, chat_dir, trace)
            for variant in ("reserve", "lend", "shared")
        ],
    }


# -- report ----------------------------------------------------------------------------------------


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _mib(n: int) -> str:
    return f"{n / MiB:.0f}"


POLICY_LABELS = {
    "ledger": "(a) ledger, by bytes",
    "ledger-no-gap": "(a') ledger, conversation gap 0",
    "count": "(b) count cap 2, fixed KV",
    "swap": "(c) one at a time",
}


def print_report(results: dict[str, Any], args: argparse.Namespace) -> None:
    models = results["models"]
    floors = results["floors"]
    print(
        f"\n## {len(models)} models under one budget of {_mib(results['budget'])} MiB "
        f"(weights + KV of the two largest), {args.rounds} round(s) of {args.duration:g} s "
        f"of chat starts, seed {args.seed}\n"
    )
    print("| model | weights MiB | KV per token KiB | fixed KV (count cap) MiB | chats/s |")
    print("|---|---|---|---|---|")
    for m in models:
        burst = f" (x{m['burst']:g} bursts)" if m["burst"] != 1 else ""
        print(
            f"| {m['name']} | {_mib(m['weights'])} | {m['kv_per_token'] / 1024:g} "
            f"| {_mib(m['fixed_kv'])} | {m['rate']:g}{burst} |"
        )
    policies = results["policies"]
    print(
        "\n| policy | requests | failed | TTFT p50 s | TTFT p99 s (rounds) | loads | unloads "
        "| most loaded | peak RSS MiB | above runtime MiB | declared MiB | budget MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, p in policies.items():
        rounds = p["ttft_p99_s_per_round"]
        unloads = ", ".join(f"{k} {v}" for k, v in sorted(p["unloads"].items())) or "0"
        print(
            f"| {POLICY_LABELS[name]} | {p['requests']} | {p['failed']} | {_s(p['ttft_p50_s'])} "
            f"| {_s(p['ttft_p99_s'])} ({rounds['min']:.2f} to {rounds['max']:.2f}) "
            f"| {p['loads']} | {unloads} | {p['peak_loaded']} | {_mib(p['peak_rss'])} "
            f"| {_mib(p['peak_above_floor'])} | {_mib(p['peak_declared'])} "
            f"| {_mib(p['budget'])} |"
        )
    print("\nTTFT per model, p50 / p99 s (requests):\n")
    print("| policy | " + " | ".join(m["name"] for m in models) + " |")
    print("|---|" + "---|" * len(models))
    for name, p in policies.items():
        cells = [
            f"{_s(v['ttft_p50_s'])} / {_s(v['ttft_p99_s'])} ({v['requests']})"
            for v in p["models"].values()
        ]
        print(f"| {POLICY_LABELS[name]} | " + " | ".join(cells) + " |")
    print(
        "\nWhere TTFT went: requests that waited for a load; seconds, summed over all "
        "requests, waiting for loads (of that for memory, of that only models inside "
        "--min-residency could have made room) and in the workers (queue + prefill); the "
        "workers' part alone at p99:\n"
    )
    print("| policy | waited for a load | load wait s | memory s | residency s | worker s "
          "| worker p99 s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, p in policies.items():
        b = p["breakdown"]
        print(
            f"| {POLICY_LABELS[name]} | {b['waited_for_load']}/{p['requests']} "
            f"| {b['load_wait_s']:.1f} | {b['memory_wait_s']:.1f} | {b['residency_wait_s']:.1f} "
            f"| {b['worker_s']:.1f} | {_s(b['worker_p99_s'])} |"
        )
    print(f"\nThe {TAIL} slowest requests per policy: TTFT = load wait (memory, residency) + "
          "worker; prompt tokens (cached):\n")  # fmt: skip
    for name, p in policies.items():
        cells = [
            f"{r['model']} {r['ttft_s']:.1f} = {r['load_wait_s']:.1f} ({r['memory_wait_s']:.1f}, "
            f"{r['residency_wait_s']:.1f}) + {r['worker_s']:.1f}; {r['prompt_tokens']} "
            f"({r['cached_tokens']})"
            for r in p["breakdown"]["slowest"]
        ]
        print(f"- {POLICY_LABELS[name]}: " + "; ".join(cells))
    for name, p in policies.items():
        for failure in p["failures"]:
            print(f"{name} FAILED: {failure}")
    print(
        f"\nRuntime floor (RSS with no model): front door + vqpoold "
        f"{_mib(floors['front_and_daemon'])} MiB, one worker {_mib(floors['worker'])} MiB; "
        "'above runtime' is the tree's RSS less these, per process alive."
    )
    if "ledger" in policies and not LOADS_BY_BYTES:
        print(
            "NOTE: this front door does not load by bytes: (a) ran with no cap at all and the "
            "ledger charging KV only."
        )
    noisy = results.get("noisy")
    if noisy:
        print(
            f"\n## Noisy neighbour: batch ({NOISY_CLIENTS} clients, {NOISY_PROMPT}-token prompts, "
            f"{NOISY_OUTPUT} tokens each, unbounded) beside chat ({noisy['chats']} chats), "
            f"KV room {_mib(noisy['kv_room'])} MiB, chat reserve {_mib(noisy['reserve'])} MiB\n"
        )
        print(
            "| pool | chat requests | chat failed | chat TTFT p50 s | chat TTFT p99 s "
            "| batch tokens/s | batch failed |"
        )
        print("|---|---|---|---|---|---|---|")
        labels = {
            "reserve": "chat reserve",
            "lend": "chat reserve, lent while unused",
            "shared": "shared, no reserves",
        }
        for v in noisy["variants"]:
            print(
                f"| {labels[v['variant']]} | {v['chat_requests']} | {v['chat_failed']} "
                f"| {_s(v['chat_ttft_p50_s'])} | {_s(v['chat_ttft_p99_s'])} "
                f"| {v['batch_tokens_per_s']:.0f} | {v['batch_failed']} |"
            )
            for failure in v["chat_failures"] + v["batch_failures"]:
                print(f"{v['variant']} FAILED: {failure}")
    print(
        f"\nload average {results['load_average']} on {os.cpu_count()} CPUs "
        "(shared: read the policies against each other)"
    )


def main() -> int:
    args = parse_args()
    # SIGTERM ends the run as Ctrl-C does: the servers started are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    base = Path(tempfile.mkdtemp(prefix="vqbm", dir="/tmp"))  # short: sockets live under it
    try:
        models = write_models(args.models_dir or base / "models")
        budget = budget_for(models)
        floors = measure_floors(base)
        progress(
            f"budget {format_bytes(budget)}; runtime floor: front door + vqpoold "
            f"{format_bytes(floors.front_and_daemon)}, a worker {format_bytes(floors.worker)}"
        )
        trace = make_trace(args.duration, args.seed)
        progress(
            f"trace: {len(trace)} chats, {sum(len(c.turns) for c in trace)} requests; "
            f"policies {', '.join(args.policies)}"
        )
        rounds: dict[str, list[RoundResult]] = {p: [] for p in args.policies}
        for round_no in range(args.rounds):
            order = args.policies if round_no % 2 == 0 else list(reversed(args.policies))
            for policy in order:
                result = play_round(policy, round_no, models, budget, trace, base, floors)
                rounds[policy].append(result)
                failed = sum(1 for o in result.outcomes if o.error)
                ttfts = [o.ttft for o in result.outcomes if o.ttft is not None]
                progress(
                    f"  round {round_no + 1} {policy}: {len(result.outcomes)} requests, "
                    f"{failed} failed, TTFT p99 {_s(percentile(ttfts, 0.99))} s, loads "
                    f"{result.loads}, peak RSS {format_bytes(result.peak_rss)}, "
                    f"{result.seconds:.0f} s"
                )
        results: dict[str, Any] = {
            "budget": budget,
            "loads_by_bytes": LOADS_BY_BYTES,
            "floors": {"front_and_daemon": floors.front_and_daemon, "worker": floors.worker},
            "models": [
                {
                    "name": m.name,
                    "weights": m.weights,
                    "kv_per_token": m.spec.kv_bytes_per_token,
                    "fixed_kv": m.fixed_kv,
                    "rate": m.spec.rate,
                    "burst": m.spec.burst,
                }
                for m in models
            ],
            "policies": {p: summarize(rs, budget) for p, rs in rounds.items()},
        }
        if not args.no_noisy:
            results["noisy"] = measure_noisy(args, base)
        results["load_average"] = "/".join(f"{x:.1f}" for x in os.getloadavg())
        if args.json:
            print(json.dumps(results, indent=2))
        else:
            print_report(results, args)
        failed = sum(p["failed"] for p in results["policies"].values())
        statuses = [s for p in results["policies"].values() for s in p["exit_statuses"]]
        return 0 if failed == 0 and not any(statuses) else 1
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
