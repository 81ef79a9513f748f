#!/usr/bin/env python3
"""What --metrics-port costs vqpoold: per request, and per scrape.

Per request: the worker request handler answering allocate(1 block) + free, called in-process
(no sockets, so the few hundred ns the metrics add are not lost in the ~50-100 us of a ZeroMQ
round trip), plain and wrapped by ``RequestMetrics.instrument``, alternating in the same run.
Reported: median ns per request of each over several rounds, the difference, and the ratio of
medians.

Per scrape: the time the daemon loop spends taking a ``MetricsSnapshot`` (it serves no request
meanwhile) and the time the HTTP thread spends turning it into the exposition text, for pools
with 1K and 16K blocks held by 4 sessions.

    scripts/bench_metrics.py            # about 15 s
    scripts/bench_metrics.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector
from vqpool.daemon.budget.accounting import BudgetAccounting
from vqpool.daemon.core.coordinator import Coordinator
from vqpool.daemon.ops.state import DaemonState
from vqpool.daemon.ops.worker_socket import WorkerRequestHandler
from vqpool.daemon.server.metrics import MetricsSnapshot, RequestMetrics, metric_families
from vqpool.shared.allocator import PoolConfig
from vqpool.shared.protocol import decode_reply, encode_request

Handle = Callable[[bytes, bytes, float], bytes]


def open_session(handle: Handle, model: str, nonce: str) -> tuple[int, str]:
    args = {"pid": os.getpid(), "model": model, "nonce": nonce, "bytes_per_block": 4096}
    reply = decode_reply(handle(encode_request(0, "hello", args), b"peer", time.monotonic()))
    return reply["result"]["sid"], reply["result"]["boot"]


def request_pairs(sid: int, boot: str, first_id: int, n: int) -> list[tuple[bytes, int]]:
    """Encoded allocate(1 block) requests with their ids; the matching frees are built from
    the replies (the block id is only known then)."""
    return [
        (
            encode_request(
                rid, "allocate", {"stream": "k", "n_tokens": 16, "owner": rid}, sid, boot
            ),
            rid,
        )
        for rid in range(first_id, first_id + 2 * n, 2)
    ]


def time_pairs(handle: Handle, sid: int, boot: str, first_id: int, n: int) -> float:
    """Mean ns per request over n allocate + free pairs."""
    allocates = request_pairs(sid, boot, first_id, n)
    now = time.monotonic()
    elapsed = 0
    for payload, rid in allocates:
        started = time.perf_counter_ns()
        reply = handle(payload, b"peer", now)
        elapsed += time.perf_counter_ns() - started
        block_id = decode_reply(reply)["result"][0]
        free = encode_request(rid + 1, "free", {"block_ids": [block_id]}, sid, boot)
        started = time.perf_counter_ns()
        handle(free, b"peer", now)
        elapsed += time.perf_counter_ns() - started
    return elapsed / (2 * n)


def bench_requests(rounds: int, n: int) -> None:
    coord = Coordinator(PoolConfig(n_blocks=4096), lease=10.0, run_dir=Path("/tmp"))
    state = DaemonState(coord, BudgetAccounting(coord, None))
    plain_handler = WorkerRequestHandler(state)
    counted_handler = WorkerRequestHandler(state)
    plain = plain_handler.handle
    counted = RequestMetrics().instrument("worker", counted_handler)
    sessions = {
        "plain": open_session(plain, "plain", "n1"),
        "counted": open_session(counted, "counted", "n2"),
    }
    next_id = {"plain": 1, "counted": 1}
    results: dict[str, list[float]] = {"plain": [], "counted": []}
    for _ in range(rounds):
        for name, handle in (("plain", plain), ("counted", counted)):
            sid, boot = sessions[name]
            results[name].append(time_pairs(handle, sid, boot, next_id[name], n))
            next_id[name] += 2 * n
    plain_ns = statistics.median(results["plain"])
    counted_ns = statistics.median(results["counted"])
    print(f"request handling, allocate(1 block) + free, {rounds} rounds x {2 * n} requests:")
    print(f"  plain handler        {plain_ns:8.0f} ns/request (median of rounds)")
    print(f"  with metrics         {counted_ns:8.0f} ns/request")
    print(
        f"  metrics add          {counted_ns - plain_ns:8.0f} ns/request  "
        f"(ratio of medians {counted_ns / plain_ns:.3f})"
    )


class _Fixed(Collector):
    def __init__(self, snap: MetricsSnapshot) -> None:
        self._snap = snap

    def collect(self) -> Iterator:  # type: ignore[type-arg]
        return metric_families(self._snap)


def bench_scrapes(rounds: int, held: int) -> None:
    coord = Coordinator(PoolConfig(n_blocks=2 * held + 64), lease=10.0, run_dir=Path("/tmp"))
    state = DaemonState(coord, BudgetAccounting(coord, None))
    handler = WorkerRequestHandler(state)
    requests = RequestMetrics()
    handle = requests.instrument("worker", handler)
    per_session = held // 4
    for i in range(4):
        sid, boot = open_session(handle, f"model-{i}", f"nonce-{i}")
        rid = 1
        for owner in range(per_session // 16):  # 16 blocks per owner, half k half v
            for stream in ("k", "v"):
                args = {"stream": stream, "n_tokens": 8 * 16, "owner": f"{i}-{owner}"}
                handle(encode_request(rid, "allocate", args, sid, boot), b"peer", 0.0)
                rid += 1
    assert coord.allocator.stats.blocks_in_use() == held, coord.allocator.stats
    take, render = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        snap = MetricsSnapshot.take(state, requests, "bench")
        take.append(time.perf_counter() - started)
        registry = CollectorRegistry()
        registry.register(_Fixed(snap))
        started = time.perf_counter()
        generate_latest(registry)
        render.append(time.perf_counter() - started)
    print(
        f"scrape, {held} blocks held by 4 sessions: loop snapshot "
        f"{1e3 * statistics.median(take):.2f} ms, exposition in the HTTP thread "
        f"{1e3 * statistics.median(render):.2f} ms (medians of {rounds})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--rounds", type=int, default=9, help="rounds per measurement (median)")
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds
    bench_requests(rounds, 500 if args.quick else 5000)
    for held in (1024, 16384):
        bench_scrapes(rounds, held)


if __name__ == "__main__":
    main()
