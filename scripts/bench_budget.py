#!/usr/bin/env python3
"""Benchmark of the byte budget on the contended demo pool: fairness between models, queue
waits, and the cost of an allocation round trip, "today" (no budget) and "with budget" in one run.

Real processes: a ``vqpoold`` and two ``vqpool-worker`` processes of the demo's built-in models
(``builtin:llama`` weight 2, ``builtin:qwen3`` weight 1), each driven by a bounded closed-loop
load (client threads, each sending one streamed request after another; every request is the
same size, so bytes held are proportional to sequences running). Two demand scenarios:

* **proportional** (the default): clients per model in proportion to its weight (20 and 10), so
  each model offers the load its share can serve and a fair policy gives every request about
  the same wait;
* **equal** (``--demand equal``): 10 clients per model. A closed-loop client asks again only
  after its answer, so a model served at half the rate keeps its clients waiting about twice as
  long (Little's law): here the wait ratio follows the share ratio, whatever the policy.

The pool holds 320 KiB of KV cache either way:

* **today**: ``--n-blocks 80`` (80 blocks of 4 KiB), no budget: a worker whose queue head
  cannot start retries every 25 ms, and whoever retries first after a free gets the blocks;
* **with budget**: a budget of 320 KiB of KV plus the two models' weights (the workers charge
  them beside their KV) with ``[models."NAME"] weight`` 2 and 1: queue heads wait
  at the daemon, whose fair queue hands freed bytes out by weighted max-min.

Measured per phase (medians over rounds), while both models have demand (both running or
queueing, per the daemon's view sampled every 50 ms): each model's share of the bytes held and
of the decode time (sequence-seconds: the requests it runs, integrated over time) against its
weight's share (target: within 10 points with the budget); the p99 queue wait (time to first
token: the queue plus a prefill of a few ms) of the most and the least favoured model (target:
ratio at most 1.5; the longer of the two over the shorter is shown too: with proportional demand
the favoured model can be the one waiting longer), and each model's requests finished per second
per sequence running (what its worker makes of the memory it holds) and the p99 wait over the
median request's duration (the wait in the model's own unit of service). Then the allocate(1
block)+free round trip against a daemon started with and without ``--budget`` (same client,
same placement, alternating rounds; target: at most 1.05x).

    scripts/bench_budget.py                  # full run, proportional demand, a few minutes
    scripts/bench_budget.py --demand both    # both scenarios, twice as long
    scripts/bench_budget.py --quick          # a smoke run of every measurement
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vqpool.daemon.ctl.summaries import per_model
from vqpool.shared.admin_client import AdminClient
from vqpool.shared.config import WORKER_SOCKET_NAME, endpoint
from vqpool.worker.models.memory import weights_bytes
from vqpool.worker.models.tiny_models import build_tiny_model
from vqpool.worker.testing.http_client import stream_events
from vqpool.worker.testing.launch import DaemonProcess, WorkerProcess

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_daemon  # the round trip: its client and CPU placement

MODELS = {"builtin:llama": 2.0, "builtin:qwen3": 1.0}  # model -> weight
BLOCK_BYTES = 4096  # a built-in model's block, per stream
POOL_BLOCKS = 80


def _weights(model: str) -> int:
    """Bytes of a built-in model's weights as its worker loads them (seed 0) and charges them."""
    return weights_bytes(build_tiny_model(model.removeprefix("builtin:"), seed=0)[0])


# The KV the pool holds, beside the weights the workers charge to the same budget.
BUDGET = f"{POOL_BLOCKS * BLOCK_BYTES + sum(_weights(m) for m in MODELS)}B"
# 40 prompt bytes + 24 tokens = 64 slots: 4 blocks per stream, 32 KiB per request; the pool
# runs 10 at once, each worker up to 8: both always want more than they get, and a weight share
# of 2/3 is 6.7 requests (the granularity costs at most a few points).
PROMPT = "budget bench: " + "x" * 26
MAX_TOKENS = 24
# Client threads per model in each demand scenario (see the module docstring).
DEMANDS = {
    "proportional": {"builtin:llama": 20, "builtin:qwen3": 10},
    "equal": {"builtin:llama": 10, "builtin:qwen3": 10},
}
# No prompt cache: the figures measure admission and fair shares of requests alone.
WORKER_ARGS = [
    *("--max-concurrent", "8", "--queue-timeout", "120", "--max-queue", "64"),
    *("--prompt-cache-bytes", "0"),
]
SAMPLE_SECONDS = 0.05


# -- the contended pool ---------------------------------------------------------------------------


@dataclass
class Tally:
    """What one phase saw: per model, sampled shares and each request's time to first token."""

    bytes_share: dict[str, float] = field(default_factory=dict)
    running_share: dict[str, float] = field(default_factory=dict)
    running_sum: dict[str, int] = field(default_factory=dict)
    samples: int = 0
    first_token: dict[str, list[float]] = field(default_factory=dict)
    duration: dict[str, list[float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def sample(self, models: dict[str, dict[str, Any]]) -> None:
        views = [models.get(m) for m in MODELS]
        if any(v is None or not (v["running"] or v["queued"]) for v in views):
            return  # a model without demand: shares say nothing about fairness
        held = sum(v["bytes_total"] for v in views if v is not None)
        running = sum(v["running"] or 0 for v in views if v is not None)
        if not held or not running:
            return
        self.samples += 1
        for model, view in zip(MODELS, views, strict=True):
            assert view is not None
            self.bytes_share[model] = self.bytes_share.get(model, 0.0) + view["bytes_total"] / held
            self.running_share[model] = (
                self.running_share.get(model, 0.0) + (view["running"] or 0) / running
            )
            self.running_sum[model] = self.running_sum.get(model, 0) + (view["running"] or 0)

    def share(self, kind: dict[str, float], model: str) -> float:
        return kind.get(model, 0.0) / self.samples if self.samples else float("nan")

    def rate_per_sequence(self, model: str, seconds: float) -> float:
        """Requests finished per second per sequence running: how fast the model's worker turns
        the memory it holds into answers (its CPU, not the pool, sets this)."""
        running = self.running_sum.get(model, 0) / self.samples if self.samples else 0.0
        done = len(self.first_token.get(model, []))
        return done / (running * seconds) if running else float("nan")

    def p99_in_durations(self, model: str) -> float:
        """The p99 wait over the median time a request of the model takes, wait included:
        the wait in the model's own unit of service, which the speed of its worker's CPU does
        not move (a fair hand-out of memory evens this out, not seconds)."""
        durations = self.duration.get(model)
        return self.p99(model) / statistics.median(durations) if durations else float("nan")

    def p99(self, model: str) -> float:
        waits = sorted(self.first_token.get(model, []))
        if not waits:
            return float("nan")
        return waits[min(len(waits) - 1, int(0.99 * len(waits)))]


def client_loop(url: str, model: str, until: float, tally: Tally) -> None:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    while time.monotonic() < until:
        started = time.monotonic()
        first: float | None = None
        try:
            for _ in stream_events(url, "/v1/completions", body):
                if first is None:
                    first = time.monotonic() - started
        except Exception as exc:
            with tally.lock:
                tally.failures.append(f"{model}: {type(exc).__name__}: {exc}")
            continue
        if first is not None:
            with tally.lock:
                tally.first_token.setdefault(model, []).append(first)
                tally.duration.setdefault(model, []).append(time.monotonic() - started)


def run_phase(
    base: Path, with_budget: bool, seconds: float, clients: dict[str, int], reserve: str
) -> Tally:
    """One phase on a fresh daemon and fresh workers (``--reserve reserve``),
    ``clients[model]`` client threads each."""
    name = "budget" if with_budget else "today"
    base = Path(tempfile.mkdtemp(prefix=name[0], dir=base))  # fresh logs: workers read theirs
    run_dir = base / "run"
    config = base / f"{name}.toml"
    lines = ["[vqpoold]", "block_size = 16", 'log_level = "WARNING"']
    if with_budget:
        lines += [f'budget = "{BUDGET}"', f"n_blocks = {POOL_BLOCKS + 16}"]
        for model, weight in MODELS.items():
            lines += ["", f'[models."{model}"]', f"weight = {weight}"]
    else:
        lines.append(f"n_blocks = {POOL_BLOCKS}")
    config.write_text("\n".join(lines) + "\n")
    daemon = DaemonProcess(run_dir, "--config", str(config), log_path=base / f"{name}.vqpoold.log")
    daemon.start()
    workers = [
        WorkerProcess(
            m, base / f"{name}-{i}.log", run_dir=run_dir, args=[*WORKER_ARGS, "--reserve", reserve]
        ).start(wait=False)
        for i, m in enumerate(MODELS)
    ]
    tally = Tally()
    try:
        for worker in workers:
            worker.wait_ready(120)
        until = time.monotonic() + seconds
        threads = [
            threading.Thread(target=client_loop, args=(w.url, w.model, until, tally))
            for w in workers
            for _ in range(clients[w.model])
        ]
        for thread in threads:
            thread.start()
        with AdminClient(run_dir) as admin:
            while time.monotonic() < until:
                tally.sample(per_model(admin.call("sessions")))
                time.sleep(SAMPLE_SECONDS)
        for thread in threads:
            thread.join()
    finally:
        for worker in workers:
            worker.stop()
        daemon.stop()
    return tally


# -- the allocation round trip --------------------------------------------------------------------


def round_trips(base: Path, rounds: int, n: int) -> dict[str, list[float]]:
    """p50 of allocate(1 block)+free per round, against vqpoold with and without ``--budget``,
    alternating, with scripts/bench_daemon.py's client and placement (daemons on one vCPU,
    this client on the other)."""
    daemons = {
        "off": bench_daemon.start_daemon(base / "rt-off"),
        "on": bench_daemon.start_daemon(base / "rt-on", "--budget", "1GiB"),
    }
    medians: dict[str, list[float]] = {"off": [], "on": []}
    cpus = os.sched_getaffinity(0) if bench_daemon.can_pin() else set()
    try:
        bench_daemon.pin(bench_daemon.CLIENT_CPU)
        sessions = {
            key: bench_daemon.Session(endpoint(base / f"rt-{key}", WORKER_SOCKET_NAME), BLOCK_BYTES)
            for key in daemons
        }
        for session in sessions.values():
            bench_daemon.alloc_free_pairs(session, 200)  # warm up
        for _ in range(rounds):
            for key, session in sessions.items():
                medians[key].append(statistics.median(bench_daemon.alloc_free_pairs(session, n)))
    finally:
        if cpus:
            os.sched_setaffinity(0, cpus)
        for process in daemons.values():
            process.send_signal(signal.SIGTERM)
            process.wait(10)
    return medians


# -- main -----------------------------------------------------------------------------------------


def report(demand: str, phases: dict[str, list[Tally]], seconds: float, rounds: int) -> int:
    """Print one demand scenario's table; returns how many requests failed."""
    clients = ", ".join(f"{n} {model}" for model, n in DEMANDS[demand].items())
    print(
        f"\n{demand} demand: contended demo pool ({BUDGET} of KV cache, clients {clients}, "
        f"{seconds:g}s per phase, median of {rounds} rounds):\n"
    )
    header = f"  {'phase':<12} {'model':<14} {'weight share':>12} {'bytes share':>12} "
    header += f"{'decode share':>12} {'p99 wait s':>10} {'requests':>8} {'req/s/seq':>9} "
    header += f"{'p99 wait / median request':>25}"
    print(header)
    weight_total = sum(MODELS.values())
    failures = 0
    for phase, tallies in phases.items():
        p99s: dict[str, float] = {}
        relative: dict[str, float] = {}
        for model, weight in MODELS.items():
            bytes_share = statistics.median(t.share(t.bytes_share, model) for t in tallies)
            decode = statistics.median(t.share(t.running_share, model) for t in tallies)
            p99s[model] = statistics.median(t.p99(model) for t in tallies)
            n = sum(len(t.first_token.get(model, [])) for t in tallies)
            rate = statistics.median(t.rate_per_sequence(model, seconds) for t in tallies)
            relative[model] = statistics.median(t.p99_in_durations(model) for t in tallies)
            print(
                f"  {phase:<12} {model:<14} {weight / weight_total:>12.0%} "
                f"{bytes_share:>12.0%} {decode:>12.0%} {p99s[model]:>10.2f} {n:>8} {rate:>9.2f} "
                f"{relative[model]:>25.2f}"
            )
        favoured = max(MODELS, key=MODELS.__getitem__)
        least = min(MODELS, key=MODELS.__getitem__)
        longer, shorter = max(p99s.values()), min(p99s.values())
        print(
            f"  {phase:<12} p99 wait ratio (least / most favoured): "
            f"{p99s[least] / p99s[favoured]:.2f} (longer / shorter {longer / shorter:.2f}); "
            f"in requests' durations: {relative[least] / relative[favoured]:.2f}; "
            f"samples with both wanting: {statistics.median(t.samples for t in tallies):.0f}"
        )
        failures += sum(len(t.failures) for t in tallies)
        for failure in [f for t in tallies for f in t.failures][:5]:
            print(f"  FAILED request ({phase}): {failure}")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--rounds", type=int, help="rounds per measurement (default 3, quick 1)")
    parser.add_argument("--seconds", type=float, help="load per phase (default 20, quick 4)")
    parser.add_argument(
        "--demand",
        choices=[*DEMANDS, "both"],
        default="proportional",
        help="clients per model: in proportion to the weights (default), equal, or both in turn",
    )
    parser.add_argument(
        "--reserve",
        choices=["on-demand", "full"],
        default="on-demand",
        help="the workers' --reserve: on-demand (default: requests grow block by block and "
        "their growths queue at the daemon's fair queue too) or full (whole requests "
        "at admission, as the figures in docs/serving.md were measured)",
    )
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    seconds = args.seconds or (4.0 if args.quick else 20.0)
    demands = list(DEMANDS) if args.demand == "both" else [args.demand]
    base = Path(tempfile.mkdtemp(prefix="vqbb-", dir="/tmp"))
    try:
        failures = 0
        for demand in demands:
            phases: dict[str, list[Tally]] = {"today": [], "with budget": []}
            for _ in range(rounds):
                phases["today"].append(
                    run_phase(base, False, seconds, DEMANDS[demand], args.reserve)
                )
                phases["with budget"].append(
                    run_phase(base, True, seconds, DEMANDS[demand], args.reserve)
                )
            failures += report(demand, phases, seconds, rounds)
        medians = round_trips(
            base, rounds * 2 if args.quick else rounds * 5, 300 if args.quick else 2000
        )
        off, on = statistics.median(medians["off"]), statistics.median(medians["on"])
        print(
            f"\nallocate(1 block)+free round trip p50: budget off {off * 1e6:.1f} us, "
            f"on {on * 1e6:.1f} us: {on / off:.3f}x (target <= 1.05x)"
        )
        return 1 if failures else 0
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
