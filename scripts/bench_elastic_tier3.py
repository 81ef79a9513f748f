"""Tier 3 of ``scripts/bench_elastic.py``: real ``vqpool-worker`` processes with built-in models.

The trace of tier 1 (same seed, same three models and arrival patterns), shortened and scaled
down to the built-in tiny llama (prompt and output lengths divided by ``LENGTH_SCALE``, the
budget likewise), played in wall-clock time against one real ``vqpoold`` and three real
``vqpool-worker`` processes (``builtin:llama`` served as ``steady``, ``bursty``, ``longctx``).
Each request is a streamed completion; its time to first token is measured by the client.
Three policies, same trace:

- ``elastic``: ``vqpoold --lend-reserves`` with the tier-1 reserves, workers with
  ``--reserve on-demand`` (grow, preempt, answer reclaims);
- ``elastic full``: the same daemon, workers with ``--reserve full`` (only the workers' reserve
  mode differs from ``elastic``: growth on demand against whole reservations);
- ``shared today``: no reserves, workers with ``--reserve full``.

Reports per policy: attainment of the TTFT objective, p99 TTFT per model, tokens generated per
second of the trace's wall time, preemptions (and per second), and the daemon's reclaim counts
and latency. On 2 shared vCPUs three workers and the client compete for
the cores: read the two policies of one run against each other, not as absolute figures.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vqpool.shared.admin_client import AdminClient
from vqpool.shared.model_weights import estimate_weights
from vqpool.worker.testing.http_client import request_json, stream_events
from vqpool.worker.testing.launch import DaemonProcess, WorkerProcess

LENGTH_SCALE = 8
"""Tier-1 token lengths and budget are divided by this for the tiny model on real cores."""
BYTES_PER_TOKEN = 2 * 4096 // 16  # builtin:llama: K + V, 4,096 bytes per 16-slot block each
MODEL = "builtin:llama"
TTFT_OBJECTIVE = 1.0


@dataclass
class Played:
    model: int
    ttft: float | None = None
    ok: bool = False


def play(
    policy: str,
    trace: Sequence[Any],
    names: Sequence[str],
    budget_tokens: int,
    reserves: dict[str, float],
) -> dict[str, Any]:
    """Play ``trace`` (tier-1 requests, lengths already scaled) under ``policy``."""
    elastic = policy != "shared today"
    with tempfile.TemporaryDirectory(prefix="vqt3") as base:
        run_dir = Path(base) / "run"
        # The budget charges each worker's weights too (at its hello): the KV budget comes on top.
        weights = estimate_weights(MODEL)
        assert weights is not None
        budget = budget_tokens * BYTES_PER_TOKEN + len(names) * weights.nbytes
        daemon_args = ["--budget", f"{budget}B", "--log-level", "WARNING"]
        if elastic:
            daemon_args.append("--lend-reserves")
        daemon = DaemonProcess(run_dir, *daemon_args).start()
        workers: list[WorkerProcess] = []
        try:
            if elastic:
                with AdminClient(run_dir, timeout=5.0) as admin:
                    for name in names:
                        reserve = int(budget_tokens * reserves[name]) * BYTES_PER_TOKEN
                        admin.call("model_set", model=name, reserve=reserve, create=True)
            reserve_mode = POLICY_RESERVE[policy]
            for name in names:
                worker = WorkerProcess(
                    MODEL,
                    Path(base) / f"{name}.log",
                    run_dir=run_dir,
                    args=[
                        "--served-model-name",
                        name,
                        "--reserve",
                        reserve_mode,
                        "--max-concurrent",
                        "8",
                        "--queue-timeout",
                        "120",
                        "--log-level",
                        "WARNING",
                    ],
                )
                workers.append(worker.start(wait=False))
            for worker in workers:
                worker.wait_ready()
            played = [Played(r.model) for r in trace]
            threads = []
            start = time.monotonic()
            for request, outcome in zip(trace, played, strict=True):
                delay = start + request.arrival - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                thread = threading.Thread(
                    target=_one, args=(workers[request.model].url, request, outcome), daemon=True
                )
                thread.start()
                threads.append(thread)
            for thread in threads:
                thread.join(300)
            seconds = time.monotonic() - start
            stats = [request_json(w.url, "GET", "/v1/stats").body for w in workers]
            with AdminClient(run_dir, timeout=5.0) as admin:
                reclaim = admin.call("budget")["reclaim"]
                audit = admin.call("audit")
        finally:
            for worker in workers:
                if worker.process is not None:
                    worker.stop()
            daemon.stop()
    return {
        "played": played,
        "stats": stats,
        "reclaim": reclaim,
        "audit": audit,
        "seconds": seconds,
    }


def _one(url: str, request: Any, outcome: Played) -> None:
    prompt = [1 + (request.rid * 13 + j * 7) % 250 for j in range(request.prompt)]
    body = {"prompt": prompt, "max_tokens": request.output, "temperature": 0}
    sent = time.monotonic()
    try:
        for event in stream_events(url, "/v1/completions", body, timeout=300):
            if outcome.ttft is None and event["choices"][0].get("text") is not None:
                outcome.ttft = time.monotonic() - sent
        outcome.ok = True
    except Exception:
        outcome.ok = False


def _p99(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))] if values else float("nan")


POLICIES = ("elastic", "elastic full", "shared today")
"""The policies tier 3 plays by default (``POLICY_RESERVE`` has each one's worker --reserve)."""
POLICY_RESERVE = {
    "elastic": "on-demand",
    "elastic auto": "auto",
    "elastic full": "full",
    "shared today": "full",
}


def figures(result: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The figures of one play: attainment, TTFTs, tokens, preemptions, reclaims."""
    played: list[Played] = result["played"]
    seconds = result["seconds"]
    tokens = sum(int(s["completion_tokens"]) for s in result["stats"])
    preemptions = sum(int(s["preemptions"]) for s in result["stats"])
    p99 = {}
    for i, name in enumerate(names):
        p99[name] = _p99([p.ttft for p in played if p.model == i and p.ttft is not None])
    return {
        "attainment": sum(
            1 for p in played if p.ok and p.ttft is not None and p.ttft <= TTFT_OBJECTIVE
        )
        / len(played),
        "failed": sum(1 for p in played if not p.ok),
        "median_ttft": statistics.median([p.ttft for p in played if p.ttft is not None] or [0.0]),
        "p99_ttft": p99,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "preemptions": preemptions,
        "preemptions_per_s": preemptions / seconds,
        "exhaustions": sum(int(s["exhaustions"]) for s in result["stats"]),
        "reclaim": result["reclaim"],
        "blocks_in_use": result["audit"]["blocks_in_use"],
    }


def _spread(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def tier3(
    trace: Sequence[Any],
    names: Sequence[str],
    budget_tokens: int,
    reserves: dict[str, float],
    policies: Sequence[str] = POLICIES,
    rounds: int = 1,
) -> None:
    """Play the scaled ``trace`` under each policy, ``rounds`` times (the order of the policies
    reversed every other round, so a busy machine's noise falls on all), and print the figures:
    each play's, then with several rounds the medians (lowest-highest) per policy."""
    print(
        f"tier 3 (real vqpoold + 3 vqpool-workers on {MODEL}, lengths / {LENGTH_SCALE}, budget "
        f"{budget_tokens} tokens, {len(trace)} requests, TTFT objective {TTFT_OBJECTIVE:g} s):"
    )
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    for i in range(rounds):
        for policy in policies if i % 2 == 0 else policies[::-1]:
            f = figures(play(policy, trace, names, budget_tokens, reserves), names)
            runs[policy].append(f)
            reclaim = f["reclaim"]
            latency = "none"
            if reclaim["latency_p50_s"] is not None:
                p50, p99 = reclaim["latency_p50_s"] * 1000, reclaim["latency_p99_s"] * 1000
                latency = f"p50 {p50:.1f} ms p99 {p99:.1f} ms"
            p99s = ", ".join(f"{n} {v:.3f}" for n, v in f["p99_ttft"].items())
            print(
                f"  {policy:<13} attainment {f['attainment']:.3f}, failed {f['failed']}, TTFT "
                f"median {f['median_ttft']:.3f} s, p99 TTFT (s): {p99s}; tokens {f['tokens']} in "
                f"{f['seconds']:.1f} s ({f['tokens_per_s']:.0f}/s); preemptions "
                f"{f['preemptions']} ({f['preemptions_per_s']:.1f}/s), ended for lack of blocks "
                f"{f['exhaustions']}; reclaims asked {reclaim['asked']}, answered "
                f"{reclaim['answered']}, late {reclaim['late']}, latency {latency}; audit blocks "
                f"in use {f['blocks_in_use']}",
                flush=True,
            )
    print(f"  (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    if rounds < 2:
        return
    print(f"  medians over {rounds} rounds (lowest-highest):")
    for policy, fs in runs.items():
        p99s = ", ".join(f"{n} {_spread([f['p99_ttft'][n] for f in fs])}" for n in names)
        print(
            f"  {policy:<13} tokens/s {_spread([f['tokens_per_s'] for f in fs])}, attainment "
            f"{_spread([f['attainment'] for f in fs])}, preemptions/s "
            f"{_spread([f['preemptions_per_s'] for f in fs])}, p99 TTFT (s) {p99s}"
        )
    if "elastic full" in runs:
        base = runs["elastic full"]
        for policy, fs in runs.items():
            if policy == "elastic full":
                continue
            ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(fs, base, strict=True)]
            print(f"  {policy} / elastic full tokens/s: rounds' ratios {_spread(ratios)}")
