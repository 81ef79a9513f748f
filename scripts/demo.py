#!/usr/bin/env python3
"""vqpool demo: two models served behind one port, their KV caches drawn from one shared pool.

What it does, end to end, with real processes:

1. starts ``vqpool serve`` (the front door) with the configuration embedded below, in a private
   run directory under /tmp (removed at the end): it starts ``vqpoold`` with a byte budget the
   two models share, with a reserve for each and weight 2 for the first (docs/budget.md), and
   serves two models on one URL: two built-in tiny models with different architectures and KV
   layouts (``builtin:llama``, ``builtin:qwen3``), or the two ``--model`` arguments (real
   mlx-lm models on a Mac);
2. sends one request naming each model to that URL: the front door starts each model's
   ``vqpool-worker`` on demand;
3. drives a short, bounded load through the same URL: a few client threads per model send
   chat requests naming their model (half of them streamed) for a fixed time; the pool is small
   enough that the two models contend for blocks and requests wait in the workers' queues;
4. shows the pool live while it runs: per stream, blocks in use and free; per model, blocks
   held per stream, bytes, requests running and queued, all as the daemon knows them (the
   workers report their requests in their heartbeat): a redrawn view on a terminal, otherwise
   one line per second, printed only when something in it changed;
5. once the load is done, checks that no block is held, shrinks the pool with
   ``vqpoolctl shrink``, prints a summary table (with each model's share of the bytes held
   while both wanted memory, and of the decode time, against its weight's share), says what
   the preemption count and the shares mean, shows the front door's view of its models (state,
   worker, loads: what ``/v1/models`` and its control socket say), stops it with SIGTERM (it
   stops its workers and vqpoold, and exits 0) and ends with the commands to try next by hand.

Exit status 0 when all of that worked, 1 otherwise (the processes' logs are printed then).

    scripts/demo                        # ~40 s
    scripts/demo --short                # ~15 s, for CI
    scripts/demo --model mlx-community/Llama-3.2-1B-Instruct-4bit \\
                 --model mlx-community/Qwen2.5-0.5B-Instruct-4bit
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from vqpool.daemon.ctl.render import bar, human_bytes, table
from vqpool.daemon.ctl.summaries import per_model
from vqpool.shared.admin_client import AdminClient
from vqpool.shared.byte_sizes import format_bytes
from vqpool.shared.model_weights import estimate_weights, serve_cache_limit, worker_overhead
from vqpool.worker.models.loading import model_spec_problem
from vqpool.worker.testing.http_client import HttpStatusError, request_json, stream_events
from vqpool.worker.testing.launch import ServeProcess

# The front door's configuration: vqpoold's settings and each model's budget, what it serves and
# its worker's options. The budget counts both models' weights (known before they load) and the
# overhead the front door charges with them (their MLX buffer-cache limits) beside their KV;
# the KV part is below. A built-in model's block holds 4 KiB per stream (K and V apart),
# so the 320 KiB of KV are 40 K + 40 V blocks of 16 token slots (640 tokens per stream), under
# the 96 block ids (48 K + 48 V): the budget binds. The demo's requests need ~4-13 blocks per
# stream each and up to 6 run at once, so the two models contend and some requests wait. Each
# model keeps a reserve (no other model gets it); the first model weighs twice the second in
# how the rest is shared. Real models (--model) get a budget their blocks fit in, and the id
# space the budget sizes (fixed at 96 ids, a real model's blocks would bind long before it).
SERVE_CONFIG = """\
# vqpool serve configuration written by scripts/demo
[vqpoold]
budget = {budget}
{id_space}block_size = 16
lease = 5.0
log_level = "WARNING"

[serve]
log_level = "WARNING"
load_timeout = {load_timeout}
queue_timeout = {load_timeout}
{load_kv}
[models.{first}]
path = {first}
reserve = "{reserve}"
weight = 2
{worker_options}
[models.{second}]
path = {second}
reserve = "{reserve}"
weight = 1
{worker_options}"""
BUILTIN_ID_SPACE = "n_blocks = 96\n"
BUILTIN_BUDGET = (320 << 10, "64KiB")
REAL_MODEL_BUDGET = (1 << 30, "128MiB")
BUILTIN_LOAD_KV = "load_kv_tokens = 128\n"
"""A load asks room for its reserve's 128 tokens of KV, not the default 2048 (1 MiB of a
built-in's KV, more than the demo's whole KV budget)."""

BUILTIN_MODELS = ["builtin:llama", "builtin:qwen3"]
CLIENTS_PER_MODEL = 4
WORKER_OPTIONS = """\
max_concurrent = 3
queue_timeout = 60
reserve_mode = "{reserve_mode}"
"""
GROWTH_WAIT_OPTION = "growth_wait = {growth_wait}\n"
EARLY_STOP = "{"
"""The stop string of ``--stop-early``: about one token in 40 the built-in models sample at the
demo's temperature (15 and 17 of 600 tokens sampled from llama and qwen3)."""
TOPICS = [
    "the unified memory of a laptop",
    "two models sharing one pool of blocks",
    "why a KV cache grows with the context",
    "a coordinator daemon and its workers",
    "paged attention in a few words",
    "what happens when the pool is full",
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="a short run for CI (~15 s)")
    parser.add_argument(
        "--model",
        action="append",
        metavar="MODEL",
        help="serve this model (give two; default: two built-in tiny models)",
    )
    parser.add_argument("--duration", type=float, help="seconds of load (default 25, short 6)")
    parser.add_argument(
        "--reserve",
        choices=["on-demand", "auto", "full"],
        default="auto",
        help="the workers' --reserve (default auto, the worker's own default: requests are "
        "reserved whole while they are seen to run to max_tokens, as here unless --stop-early, "
        "and grow block by block otherwise, their growth waiting in the budget's fair queue)",
    )
    parser.add_argument(
        "--growth-wait",
        type=float,
        metavar="SECONDS",
        help="the workers' --growth-wait (default: the worker's own)",
    )
    parser.add_argument(
        "--load-at",
        type=float,
        metavar="UNIX_TIME",
        help="start the load at this wall-clock time (once the models are loaded; at once if "
        "later): runs started together load the machine together (scripts/bench_reserve.py "
        "--together)",
    )
    parser.add_argument(
        "--stop-early",
        action="store_true",
        help=f"requests also stop at {EARLY_STOP!r}: answers end well before max_tokens, as a "
        "real model's end at its EOS (the built-in byte models have none: without this option "
        "every answer runs to max_tokens)",
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="also write the run's figures there (per model: the worker's /v1/stats, p99 TTFT, "
        "503s; preemptions and seconds under load): scripts/bench_reserve.py reads them",
    )
    args = parser.parse_args()
    if args.model is not None and len(args.model) != 2:
        parser.error("give --model exactly twice (two models share the pool)")
    for model in args.model or ():
        problem = model_spec_problem(model)
        if problem is not None:
            parser.exit(2, f"demo: {problem}\n")
    return args


# -- load ------------------------------------------------------------------------------------------


@dataclass
class ClientTally:
    """What the clients of one model saw."""

    ok: int = 0
    refused: int = 0  # 503: waited --queue-timeout in the worker's queue
    failed: list[str] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)  # seconds to the first token, streamed
    lock: threading.Lock = field(default_factory=threading.Lock)


def one_request(
    url: str, model: str, rng: random.Random, stream: bool, max_tokens: int, stop_early: bool
) -> float | None:
    """One chat request for ``model`` of up to ``max_tokens``; its time to first token when
    streamed; raises on anything but a complete answer."""
    words = rng.randint(4, 30)
    topic = rng.choice(TOPICS)
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"In {words} words: {topic}."}],
        "max_tokens": rng.randint(max_tokens // 5, max_tokens),
        "temperature": 0.7,
    }
    if stop_early:
        body["stop"] = [EARLY_STOP]
    if stream:
        sent = time.monotonic()
        ttft = None
        events = []
        for event in stream_events(url, "/v1/chat/completions", body):
            if ttft is None and event["choices"][0].get("delta", {}).get("content"):
                ttft = time.monotonic() - sent
            events.append(event)
        if not events or events[-1]["choices"][0]["finish_reason"] is None:
            raise RuntimeError("the stream ended without a finish_reason")
        return ttft
    reply = request_json(url, "POST", "/v1/chat/completions", body)
    if reply.status != 200:
        raise HttpStatusError(reply)
    return None


def client_loop(
    url: str,
    model: str,
    seed: int,
    until: float,
    max_tokens: int,
    stop_early: bool,
    tally: ClientTally,
) -> None:
    rng = random.Random(seed)
    n = 0
    while time.monotonic() < until:
        try:
            ttft = one_request(
                url, model, rng, stream=n % 2 == 0, max_tokens=max_tokens, stop_early=stop_early
            )
            with tally.lock:
                tally.ok += 1
                if ttft is not None:
                    tally.ttfts.append(ttft)
        except HttpStatusError as exc:
            with tally.lock:
                if exc.reply.status == 503:  # the front door's or the worker's
                    tally.refused += 1
                else:
                    tally.failed.append(str(exc))
        except Exception as exc:
            with tally.lock:
                tally.failed.append(f"{type(exc).__name__}: {exc}")
        n += 1


# -- live view -------------------------------------------------------------------------------------


def pool_snapshot(admin: AdminClient) -> dict[str, Any]:
    """The pool and each model's blocks and requests, as the daemon sees them."""
    return {
        "streams": admin.call("stats")["streams"],
        "models": per_model(admin.call("sessions")),
        "budget": {v["model"]: v for v in admin.call("model_list")["models"]},
    }


@dataclass
class ShareTally:
    """Each model's share of the bytes held, summed over the live view's samples in which
    every model wanted memory (held some or waited for some)."""

    held: dict[str, float] = field(default_factory=dict)
    samples: int = 0

    def add(self, views: dict[str, dict[str, Any]], models: list[str]) -> None:
        wanted = [views.get(m) for m in models]
        if any(v is None or not (v["held"] or v["waiting"]) for v in wanted):
            return
        total = sum(v["held"] for v in wanted if v is not None)
        if total:
            self.samples += 1
            for model, view in zip(models, wanted, strict=True):
                assert view is not None
                self.held[model] = self.held.get(model, 0.0) + view["held"] / total

    def share(self, model: str) -> float | None:
        return self.held.get(model, 0.0) / self.samples if self.samples else None


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def render_screen(snap: dict[str, Any], elapsed: float, duration: float) -> str:
    lines = [
        f"vqpool demo: two models, one KV block pool   [{elapsed:4.0f}s / {duration:.0f}s]",
        "",
    ]
    for name, s in snap["streams"].items():
        used = s["total"] - s["free"]
        fraction = used / s["total"] if s["total"] else 0.0
        lines.append(
            f"  pool {name:>2}  [{bar(fraction, 32)}] {used:4d} in use {s['free']:4d} free"
        )
    lines.append("")
    for model, m in snap["models"].items():
        blocks = "  ".join(f"{k} {v:3d}" for k, v in sorted(m["blocks"].items())) or "-"
        lines.append(
            f"  {model:<28} blocks {blocks:<14} {human_bytes(m['bytes_total']):>10}   "
            f"running {_count(m['running'])}  queued {_count(m['queued'])}"
        )
    return "\n".join(lines)


def render_line(snap: dict[str, Any]) -> str:
    """The pool in one line (without the time, so that two lines can be compared). The pool and
    each model in the same units: blocks of all streams (K and V counted apart, as the daemon
    does) and bytes of K and V together."""
    streams = snap["streams"]
    used = sum(s["total"] - s["free"] for s in streams.values())
    total = sum(s["total"] for s in streams.values())
    held = sum(m["bytes_total"] for m in snap["models"].values())
    models = " | ".join(
        f"{model}: blocks {sum(m['blocks'].values())}, {human_bytes(m['bytes_total'])}, "
        f"running {_count(m['running'])}, queued {_count(m['queued'])}"
        for model, m in snap["models"].items()
    )
    return (
        f"pool {used}/{total} blocks in use ({'+'.join(streams)}), {human_bytes(held)} | {models}"
    )


def live_view(sample: Callable[[], dict[str, Any]], stop: threading.Event, duration: float) -> None:
    tty = sys.stdout.isatty()
    started = time.monotonic()
    last_line = ""
    while not stop.is_set():
        elapsed = time.monotonic() - started
        try:
            snap = sample()
        except Exception as exc:  # a view that misses a beat is not a failure of the demo
            print(f"(live view: {exc})", flush=True)
        else:
            if tty:
                print("\x1b[H\x1b[2J" + render_screen(snap, elapsed, duration), flush=True)
            elif (line := render_line(snap)) != last_line:  # a log, not a ticker
                print(f"[{elapsed:5.1f}s] {line}", flush=True)
                last_line = line
        stop.wait(0.5 if tty else 1.0)


# -- summary ---------------------------------------------------------------------------------------


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def summary(
    all_stats: dict[str, dict[str, Any]],
    tallies: dict[str, ClientTally],
    shrink: list[dict[str, Any]],
    shares: ShareTally,
    views: dict[str, dict[str, Any]],
) -> None:
    busy_total = sum(s["busy_seconds"] for s in all_stats.values())
    weight_total = sum(views[m]["weight"] for m in all_stats if m in views)
    headers = [
        "model",
        "reserve",
        "weight",
        "weight share",
        "bytes share",
        "decode share",
        "requests",
        "tokens",
        "tokens/s",
        "peak blocks",
        "peak bytes",
        "waits",
        "preempted",
        "by reclaim",
        "held",
        "exhaustions",
        "503s",
        "p99 TTFT",
    ]
    rows: list[list[object]] = []
    for model in all_stats:
        stats = all_stats[model]
        view = views.get(model, {})
        rows.append(
            [
                model,
                format_bytes(view["reserve"]) if view else "-",
                view.get("weight", "-"),
                _percent(view["weight"] / weight_total if view and weight_total else None),
                _percent(shares.share(model)),
                _percent(stats["busy_seconds"] / busy_total if busy_total else None),
                stats["ended_stop"] + stats["ended_length"],
                stats["completion_tokens"],
                round(stats["tokens_per_s"]),
                stats["peak_blocks"],
                human_bytes(stats["peak_bytes"]),
                stats["waits"],
                stats["preemptions"],
                stats["reclaim_preemptions"],
                stats["held_for_growth"],
                stats["exhaustions"],
                tallies[model].refused,
                _p99_seconds(tallies[model].ttfts),
            ]
        )
    print("\nPer model (bytes share: of the bytes held while both models wanted memory, mean")
    print(f"over {shares.samples} samples; decode share: of the workers' decode time;")
    print("tokens/s: generated tokens per busy second of the worker; blocks count K and V")
    print("blocks apart; waits: requests that queued for memory; preempted: requests that gave")
    print("way, to their own model's growth or to a reclaim, and were resumed; by reclaim:")
    print("those for a reclaim ask; held: admissions held until the running requests' next")
    print("growth could be backed, when requests grow on demand; p99 TTFT: of the streamed")
    print("requests, as their clients measured it):\n")
    print(textwrap.indent(table(headers, rows, right=["reserve", "peak bytes"]), "  "))
    retired = sum(r["retired"] for r in shrink)
    per_stream = ", ".join(
        f"{r['stream']}: {r['retired']} retired, {r['n_total']} left" for r in shrink
    )
    print(f"\nShrink (vqpoolctl shrink): {retired} blocks retired ({per_stream})")


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _p99_seconds(values: list[float]) -> str:
    p99 = _p99(values)
    return "-" if p99 is None else f"{p99:.2f}s"


# The demo's pool is small on purpose, so its preemption rate is high: on a 2-vCPU box runs of
# the default options preempt 8-20 requests a second. Well above that, something else is slow.
USUAL_PREEMPTIONS_PER_S = 30.0

TRY_NEXT = """
Try next, by hand (the demo has stopped its front door, workers and daemon):
  vqpool serve --model builtin:llama --model builtin:qwen3 &    # vqpoold too; port 8080
  curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"model": "builtin:qwen3", "messages": [{"role": "user", "content": "Hello"}]}'
  curl http://127.0.0.1:8080/v1/models            # every model, loaded or not
  vqpoolctl watch                                 # the pool live, per model
  vqpool serve --model PATH                       # serve a real mlx-lm model directory"""


def what_it_showed(preemptions_per_s: float, reserve: str) -> str:
    """Two short paragraphs: whether the preemption rate is normal, and what weights govern."""
    if reserve == "full":
        preemptions = (
            "Preemptions: with --reserve full a request reserves all it needs at its start, so\n"
            "few are preempted: mostly when a reclaim takes their model's bytes back."
        )
    else:
        verdict = (
            "normal for this deliberately small pool"
            if preemptions_per_s <= USUAL_PREEMPTIONS_PER_S
            else f"more than this demo usually shows (up to {USUAL_PREEMPTIONS_PER_S:.0f}/s)"
        )
        how = (
            "With --reserve auto a request is reserved whole while requests are seen to run to\n"
            "max_tokens (here they do, unless --stop-early), and grows its memory on demand\n"
            "otherwise"
            if reserve == "auto"
            else "A request grows its memory on demand"
        )
        preemptions = (
            f"Preemptions: {preemptions_per_s:.1f}/s is {verdict}.\n{how}. A request starts\n"
            "only once the running ones' next growth is backed, and when the pool is full\n"
            "the request cheapest to recompute gives way and resumes later from its cached\n"
            "prompt, with identical tokens: it is delayed, not cut."
        )
    weights = (
        "Weights govern memory, not CPU: the bytes share leans to the weights while both models\n"
        "want memory; the decode share follows each worker's own load and is not expected to\n"
        "follow the weights."
    )
    return f"\n{preemptions}\n{weights}"


# -- main ------------------------------------------------------------------------------------------


def cpu_seconds(serve: ServeProcess) -> dict[str, float]:
    """CPU seconds (user + system) each process of the demo used so far, by role: the front
    door, vqpoold, each model's worker, and this process (the clients)."""
    roles: dict[str, psutil.Process] = {"front door": psutil.Process(serve.pid)}
    workers = {row["pid"]: name for name, row in serve.rows().items() if row["pid"]}
    for child in roles["front door"].children():
        if child.pid in workers:
            roles[f"worker {workers[child.pid]}"] = child
        elif "vqpool.daemon" in " ".join(child.cmdline()):
            roles["vqpoold"] = child
    roles["clients"] = psutil.Process()
    out = {}
    for role, process in roles.items():
        times = process.cpu_times()
        out[role] = times.user + times.system
    return out


def drop_prompt_caches(admin: AdminClient, timeout: float = 10.0) -> int:
    """Make every model's workers drop their prompt caches (what ``vqpoolctl cache drop``
    does) and wait until the pool holds no block; the cached bytes they last reported."""
    models = {session["model"] for session in admin.call("sessions")}
    cached = sum(admin.call("cache_drop", model=model)["cached_bytes"] for model in models)
    deadline = time.monotonic() + timeout
    while admin.call("stats")["stats"]["blocks_in_use"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return cached


def shrink_pool(run_dir: Path, admin: AdminClient) -> list[dict[str, Any]]:
    """Retire half of each stream's blocks with the admin command; its JSON result."""
    streams = admin.call("stats")["streams"]
    target = min(s["total"] for s in streams.values()) // 2
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "vqpool.daemon.ctl",
            "--run-dir",
            str(run_dir),
            "shrink",
            "--stream",
            "kv",
            "--target-free",
            str(target),
            "--json",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    result: list[dict[str, Any]] = json.loads(out.stdout)
    return result


def load_on_demand(url: str, models: list[str], timeout: float) -> dict[str, float | str]:
    """One small request per model, all at once, through the one URL: the front door starts
    each model's worker for its first request. Per model, the seconds its first answer took,
    or the front door's one-line reason for a model that could not be loaded."""
    took: dict[str, float | str] = {}

    def first_request(model: str) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        started = time.monotonic()
        reply = request_json(url, "POST", "/v1/chat/completions", body, timeout=timeout)
        if reply.status == 200:
            took[model] = time.monotonic() - started
        else:
            error = reply.body.get("error", {}) if isinstance(reply.body, dict) else {}
            took[model] = str(error.get("message", reply.body))

    threads = [threading.Thread(target=first_request, args=(m,)) for m in models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return took


def front_door_view(serve: ServeProcess) -> str:
    """The front door's rows (what ``/v1/models`` and its control socket say), as a table."""
    headers = ["model", "state", "pid", "worker", "running", "queued", "loads", "unloads", "idle"]
    rows: list[list[object]] = []
    for name, row in serve.rows().items():
        unloads = ", ".join(f"{why} {n}" for why, n in row["unloads"].items()) or "0"
        idle = "-" if row["idle_s"] is None else f"{row['idle_s']:.1f} s"
        rows.append(
            [name, row["state"], row["pid"] or "-", row["url"] or "-", row["running"],
             row["queued"], row["loads"], unloads, idle]
        )  # fmt: skip
    return table(headers, rows)


def models_fixed_costs(models: list[str]) -> list[int]:
    """Each model's fixed cost in bytes, known before it loads: its weights from its files
    (0 when they cannot tell, e.g. a hub id not downloaded yet: its worker's hello charges them,
    and the KV gets less) and the overhead the front door charges beside them (its worker's MLX
    buffer-cache limit, an eighth of the weights, and 8 MiB for its runtime's growth)."""
    costs = []
    for model in models:
        found = estimate_weights(model)
        weights = None if found is None else found.nbytes
        costs.append((weights or 0) + worker_overhead(serve_cache_limit(weights)))
    return costs


def run(args: argparse.Namespace, base: Path) -> bool:
    models = args.model or BUILTIN_MODELS
    duration = args.duration or (6.0 if args.short else 25.0)
    # Requests in flight when the load ends still finish: short requests keep that tail short
    # on a slow or busy machine.
    max_tokens = 96 if args.short else 160
    run_dir = base / "run"
    config = base / "vqpool.toml"
    kv_budget, reserve = BUILTIN_BUDGET if args.model is None else REAL_MODEL_BUDGET
    budget = kv_budget + sum(models_fixed_costs(models))
    load_timeout = 60 if args.model is None else 1800  # real models may download
    first, second = (json.dumps(m) for m in models)  # TOML strings
    config.write_text(
        SERVE_CONFIG.format(
            budget=budget,
            id_space=BUILTIN_ID_SPACE if args.model is None else "",
            load_kv=BUILTIN_LOAD_KV if args.model is None else "",
            reserve=reserve,
            first=first,
            second=second,
            load_timeout=load_timeout,
            worker_options=WORKER_OPTIONS.format(reserve_mode=args.reserve)
            + (
                ""
                if args.growth_wait is None
                else GROWTH_WAIT_OPTION.format(growth_wait=args.growth_wait)
            ),
        )
    )
    serve = ServeProcess(run_dir, base / "serve.log", ["--config", str(config)])
    ok = explained = False
    try:
        print(
            f"starting vqpool serve (run directory {run_dir}): vqpoold and {len(models)} models "
            "behind one port ...",
            flush=True,
        )
        serve.start()
        print(f"  serving {', '.join(models)} on {serve.url}", flush=True)
        for model, took in load_on_demand(serve.url, models, load_timeout + 30).items():
            if isinstance(took, str):
                # The front door passed the worker's one-line reason on: say only that.
                print(f"demo: {took}", file=sys.stderr)
                explained = True
                raise SystemExit(2)
            row = serve.rows()[model]
            print(
                f"  {model}: loaded by its first request in {took:.1f} s (worker pid "
                f"{row['pid']} on {row['url']})",
                flush=True,
            )
        workers = {name: row["url"] for name, row in serve.rows().items()}

        with AdminClient(run_dir) as admin:
            tallies = {m: ClientTally() for m in models}
            if args.load_at is not None:
                time.sleep(max(0.0, args.load_at - time.time()))
            load_started = time.time()
            until = time.monotonic() + duration
            clients = [
                threading.Thread(
                    target=client_loop,
                    args=(
                        serve.url,
                        m,
                        100 * i + c,
                        until,
                        max_tokens,
                        args.stop_early,
                        tallies[m],
                    ),
                )
                for i, m in enumerate(models)
                for c in range(CLIENTS_PER_MODEL)
            ]
            print(
                f"driving {len(clients)} clients for {duration:.0f}s at {serve.url} ...\n",
                flush=True,
            )
            stop_view = threading.Event()
            shares = ShareTally()

            def sample() -> dict[str, Any]:
                snap = pool_snapshot(admin)
                shares.add(snap["budget"], models)
                return snap

            view = threading.Thread(target=live_view, args=(sample, stop_view, duration))
            reclaim_before = admin.call("budget")["reclaim"]
            cpu_before = cpu_seconds(serve)
            started = time.monotonic()
            view.start()
            for client in clients:
                client.start()
            for client in clients:
                client.join()
            stop_view.set()
            view.join()
            reclaim = admin.call("budget")["reclaim"]
            loaded = time.monotonic() - started
            cpu = {
                role: seconds - cpu_before.get(role, 0.0)
                for role, seconds in cpu_seconds(serve).items()
            }

            failures = [f"{m}: {f}" for m, t in tallies.items() for f in t.failed]
            # Ended requests' KV stays in the workers' prompt caches until memory is wanted:
            # dropped here, so that what is left in use would be a leak.
            cached = drop_prompt_caches(admin)
            stats = admin.call("stats")
            in_use = stats["stats"]["blocks_in_use"]
            audit = admin.call("audit")
            shrink = shrink_pool(run_dir, admin)
            views = {v["model"]: v for v in admin.call("model_list")["models"]}
            all_stats = {
                m: request_json(url, "GET", "/v1/stats").body for m, url in workers.items()
            }
            summary(all_stats, tallies, shrink, shares, views)
            preempted = reclaim["preemptions"] - reclaim_before["preemptions"]
            asked = reclaim["asked"] - reclaim_before["asked"]
            print(
                f"\nPreemptions under load: {preempted} ({preempted / loaded:.1f}/s over "
                f"{loaded:.1f}s); reclaim asks: {asked} ({asked / loaded:.1f}/s); workers' "
                f"--reserve {args.reserve}"
            )
            print(what_it_showed(preempted / loaded, args.reserve))
            print(
                f"\nprompt caches dropped (vqpoolctl cache drop): {human_bytes(cached)}; blocks "
                f"in use after the load: {in_use}; audit: {'ok' if audit['ok'] else audit}"
            )
            if args.json:
                figures = {
                    "reserve": args.reserve,
                    "seconds": loaded,
                    "preemptions": preempted,
                    "reclaim_asks": asked,
                    "cpu_seconds": cpu,
                    "load_started": load_started,
                    "load_average": psutil.getloadavg()[0],
                    "models": {
                        m: {
                            "stats": all_stats[m],
                            "p99_ttft": _p99(tallies[m].ttfts),
                            "refused": tallies[m].refused,
                            "ok": tallies[m].ok,
                        }
                        for m in models
                    },
                }
                Path(args.json).write_text(json.dumps(figures, indent=1))
            ok = not failures and in_use == 0 and audit["ok"]
            for failure in failures[:10]:
                print(f"FAILED request: {failure}")
        print("\nThe front door's view of its models (its control socket; /v1/models alike):\n")
        print(textwrap.indent(front_door_view(serve), "  "))
        children = psutil.Process(serve.pid).children(recursive=True)
        status = serve.stop()
        _, left = psutil.wait_procs(children, timeout=10)
        print(
            f"\nvqpool serve stopped workers and vqpoold (SIGTERM: exit status {status}, "
            f"{len(left)} of its {len(children)} processes left)"
        )
        ok = ok and status == 0 and not left
        if ok:
            print(TRY_NEXT)
        return ok
    finally:
        if serve.process is not None and serve.process.poll() is None:
            serve.stop()
        if not ok and not explained:
            for log in [*sorted(base.glob("*.log")), *sorted(run_dir.glob("workers/*.log"))]:
                print(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}")


def main() -> int:
    args = parse_args()
    base = Path(tempfile.mkdtemp(prefix="vqdemo-", dir="/tmp"))
    try:
        return 0 if run(args, base) else 1
    except KeyboardInterrupt:
        return 130
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
