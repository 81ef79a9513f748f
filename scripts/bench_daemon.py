#!/usr/bin/env python3
"""Benchmark of vqpoold round trips against a bare pyzmq DEALER/ROUTER echo, in the same run.

Every measurement runs twice per round, once against a real ``vqpoold`` and once against a bare
ROUTER that echoes each frame back, with the same client code, the same messages and the same
CPU placement (server on one vCPU, clients on another: where the two processes land moves
latency 2x on this machine kind, see FACTS.md). Figures are medians over rounds (5 by default),
each printed beside the echo's from the same rounds; each ratio is the median of the per-round
ratios (daemon and echo measured back to back in every round), with its spread (lowest to
highest round), so a figure that swings between runs shows it. The round trip and allocate_many
are measured side by side by one client, daemon and echo alternating in slices (100 pairs, or one
allocate_many round), so that a neighbour's burst of load on a shared machine falls on both.

Measured:
* allocate(1 block) + free round trip (two requests): p50 and p99; target p50 within 1.15x echo;
* requests/s of allocate+free loops from 1, 2 and 4 client processes;
* allocate_many of 64 one-block allocations in one message against 64 separate allocate calls:
  blocks/s, target >= 20x;
* the same round trip through PoolClient (the worker library), for its own overhead;
* with ``--budget SIZE``: the same round trip against a second vqpoold run with that memory
  budget, its sessions declaring bytes per block (so every allocation goes through the budget
  ledger), side by side with the first; target p50 within 1.05x of the daemon without budget.

    scripts/bench_daemon.py            # full run, about a minute
    scripts/bench_daemon.py --quick    # a smoke run of every measurement
    scripts/bench_daemon.py --budget 1GiB  # also the round trip with a memory budget on
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq
from vqpool.shared.admin_client import AdminClient
from vqpool.shared.errors import DaemonUnavailableError
from vqpool.shared.protocol import encode_request

BENCH_BYTES_PER_BLOCK = 4096
"""Bytes per block the sessions of the budget measurement declare (a tiny model's block)."""

SERVER_CPU = 0
CLIENT_CPU = 1


def can_pin() -> bool:
    """Whether processes can be pinned to the two vCPUs this benchmark uses."""
    return hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > CLIENT_CPU


def pin(cpu: int) -> None:
    """Pin this process to ``cpu`` where the OS allows it (Linux); elsewhere leave it free."""
    if can_pin():
        os.sched_setaffinity(0, {cpu})


# -- the bare echo server ----------------------------------------------------------------------


def echo_server(endpoint: str) -> None:
    """A ROUTER that sends every message straight back (blocking recv, as lean as it gets)."""
    pin(SERVER_CPU)
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.bind(endpoint)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("ready", flush=True)
    while True:
        sock.send_multipart(sock.recv_multipart())


# -- clients -------------------------------------------------------------------------------------


class Session:
    """A raw DEALER session (hello first when the server is vqpoold)."""

    def __init__(self, endpoint: str, bytes_per_block: int | None = None) -> None:
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.next_id = 1
        args: dict[str, Any] = {"pid": os.getpid(), "model": "bench", "nonce": os.urandom(8).hex()}
        if bytes_per_block is not None:  # priced by the daemon's memory budget
            args["bytes_per_block"] = bytes_per_block
        result = self.call("hello", args).get("result")
        # An echo server answers with the request itself: no session, same message shapes.
        self.sid: int = result["sid"] if result else 0
        self.boot: str = result["boot"] if result else ""

    def call(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        rid = self.next_id
        self.next_id += 1
        sid = getattr(self, "sid", None)
        self.sock.send(encode_request(rid, op, args, sid, getattr(self, "boot", None)))
        reply: dict[str, Any] = msgpack.unpackb(self.sock.recv())
        return reply


def alloc_free_pairs(session: Session, n: int) -> list[float]:
    """Seconds per allocate(1 block) + free pair, ``n`` times."""
    times = []
    perf = time.perf_counter
    for i in range(n):
        started = perf()
        reply = session.call("allocate", {"stream": "k", "n_tokens": 1, "owner": i})
        block_ids = reply.get("result") or [0]
        session.call("free", {"block_ids": block_ids})
        times.append(perf() - started)
    return times


def batch_vs_single(session: Session, rounds: int) -> tuple[float, float]:
    """Seconds for 64 one-block allocations: as 64 calls, and as one allocate_many."""
    single_total = batch_total = 0.0
    perf = time.perf_counter
    for _ in range(rounds):
        ids: list[int] = []
        started = perf()
        for i in range(64):
            reply = session.call("allocate", {"stream": "k", "n_tokens": 1, "owner": i})
            ids += reply.get("result") or []
        single_total += perf() - started
        session.call("free", {"block_ids": ids})
        items = [["k", 1, i, "fp16"] for i in range(64)]
        started = perf()
        reply = session.call("allocate_many", {"items": items})
        batch_total += perf() - started
        result = reply.get("result")
        ids = [bid for item in result for bid in item] if result else []
        session.call("free", {"block_ids": ids})
    return single_total / rounds, batch_total / rounds


def pool_client_pairs(run_dir: str, n: int) -> list[float]:
    """Seconds per allocate(1)+free pair through PoolClient (daemon only)."""
    from vqpool.worker import PoolClient

    times = []
    perf = time.perf_counter
    with PoolClient(run_dir, name="bench") as pool:
        for i in range(n):
            started = perf()
            pool.free(pool.allocate("k", 1, i))
            times.append(perf() - started)
    return times


SLICE = 100
"""Pairs per slice when a client measures the daemon and the echo side by side."""


def side_by_side(args: argparse.Namespace) -> dict[str, Any]:
    """The daemon (``--endpoint``) and the echo (``--other``) measured by one client in
    alternating slices (daemon, echo, echo, daemon...): a neighbour's burst of load on the shared
    machine falls on both alike, not on whichever ran in that second."""
    sessions = [Session(args.endpoint, args.bytes_per_block), Session(args.other)]
    for session in sessions:
        alloc_free_pairs(session, 200)  # warm up
    print("ready", flush=True)
    sys.stdin.readline()
    times: list[list[float]] = [[], []]
    batches: list[list[tuple[float, float]]] = [[], []]
    for slice_no in range(max(1, args.count // (SLICE if args.task == "pairs" else 1))):
        for which in (0, 1) if slice_no % 2 == 0 else (1, 0):
            if args.task == "pairs":
                times[which] += alloc_free_pairs(sessions[which], SLICE)
            else:
                batches[which].append(batch_vs_single(sessions[which], 1))
    if args.task == "pairs":
        return {"times": times[0], "other_times": times[1]}
    (single, batch), (other_single, other_batch) = (
        (statistics.mean(s for s, _ in runs), statistics.mean(b for _, b in runs))
        for runs in batches
    )
    return {
        "single": single,
        "batch": batch,
        "other_single": other_single,
        "other_batch": other_batch,
    }


def client_main(args: argparse.Namespace) -> None:
    """One client process: connect, say ready, wait for "go", measure, print JSON."""
    pin(CLIENT_CPU)
    if args.task == "poolclient":
        print("ready", flush=True)
        sys.stdin.readline()
        pool_client_pairs(args.run_dir, args.count // 10)  # warm up
        print(json.dumps({"times": pool_client_pairs(args.run_dir, args.count)}), flush=True)
        return
    if args.other:
        print(json.dumps(side_by_side(args)), flush=True)
        return
    session = Session(args.endpoint, args.bytes_per_block)
    alloc_free_pairs(session, 200)  # warm up
    print("ready", flush=True)
    sys.stdin.readline()
    if args.task == "pairs":
        result: dict[str, Any] = {"times": alloc_free_pairs(session, args.count)}
    elif args.task == "throughput":
        started = time.perf_counter()
        alloc_free_pairs(session, args.count)
        result = {"requests": 2 * args.count, "seconds": time.perf_counter() - started}
    else:
        single, batch = batch_vs_single(session, args.count)
        result = {"single": single, "batch": batch}
    print(json.dumps(result), flush=True)


# -- orchestration -------------------------------------------------------------------------------


def spawn(argv: list[str]) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, __file__, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    if process.stdout.readline().strip() != "ready":
        raise RuntimeError(f"{argv} did not start")
    return process


def run_clients(
    endpoint: str,
    run_dir: str,
    task: str,
    count: int,
    n: int,
    bytes_per_block: int | None = None,
    other: str | None = None,
) -> list[Any]:
    """Start ``n`` client processes, release them together, collect their JSON results; with
    ``other``, each measures ``endpoint`` and ``other`` side by side (see side_by_side)."""
    argv = ["--client", task, "--endpoint", endpoint, "--run-dir", run_dir, "--count", str(count)]
    if bytes_per_block is not None:
        argv += ["--bytes-per-block", str(bytes_per_block)]
    if other is not None:
        argv += ["--other", other]
    clients = [spawn(argv) for _ in range(n)]
    for client in clients:
        assert client.stdin is not None
        client.stdin.write("go\n")
        client.stdin.flush()
    results = []
    for client in clients:
        assert client.stdout is not None
        results.append(json.loads(client.stdout.readline()))
        client.wait()
    return results


def daemon_argv(run_dir: Path, *options: str) -> list[str]:
    """The command line of the vqpoold every measurement runs against."""
    return [
        sys.executable,
        "-m",
        "vqpool.daemon",
        "--run-dir",
        str(run_dir),
        "--n-blocks",
        "65536",
        "--log-level",
        "WARNING",
        *options,
    ]


def start_daemon(run_dir: Path, *options: str) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(daemon_argv(run_dir, *options), preexec_fn=lambda: pin(SERVER_CPU))
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            with AdminClient(run_dir, timeout=0.5) as admin:
                admin.call("ping")
            return process
        except DaemonUnavailableError:
            time.sleep(0.05)
    raise RuntimeError("vqpoold did not start")


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--rounds", type=int, default=5, help="runs per measurement (median)")
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument("--echo", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--other", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--bytes-per-block", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--budget",
        metavar="SIZE",
        help="also measure the round trip against a vqpoold with this memory budget",
    )
    args = parser.parse_args()
    if args.client:
        args.task = args.client
        client_main(args)
        return
    if args.echo:
        echo_server(args.echo)
        return

    rounds = 1 if args.quick else args.rounds
    pairs, throughput, batches = (200, 500, 5) if args.quick else (3000, 3000, 40)
    base = Path(tempfile.mkdtemp(prefix="vqb", dir="/tmp"))
    run_dir = base / "run"
    daemon_endpoint = f"ipc://{run_dir}/worker.sock"
    echo_endpoint = f"ipc://{base}/echo.sock"
    daemon = start_daemon(run_dir)
    budget_run_dir = base / "budget"
    budget_daemon = start_daemon(budget_run_dir, "--budget", args.budget) if args.budget else None
    budget_p50: list[float] = []
    plain_p50: list[float] = []
    echo = spawn(["--echo", echo_endpoint])
    placement = (
        f"servers on cpu {SERVER_CPU}, clients on cpu {CLIENT_CPU}"
        if can_pin()
        else "not pinned (no sched_setaffinity here)"
    )
    print(f"placement: {placement}; {rounds} round(s); medians over rounds")
    targets = {"daemon": daemon_endpoint, "echo": echo_endpoint}
    p50: dict[str, list[float]] = {"daemon": [], "echo": []}
    p99: dict[str, list[float]] = {"daemon": [], "echo": []}
    rps: dict[tuple[str, int], list[float]] = {}
    batch: dict[str, list[tuple[float, float]]] = {"daemon": [], "echo": []}
    client_p50: list[float] = []
    try:
        for round_no in range(rounds):
            # The round trip and allocate_many: daemon and echo side by side in one client.
            (result,) = run_clients(
                daemon_endpoint, str(run_dir), "pairs", pairs, 1, None, echo_endpoint
            )
            for name, times in (("daemon", result["times"]), ("echo", result["other_times"])):
                p50[name].append(statistics.median(times))
                p99[name].append(percentile(times, 99))
            (result,) = run_clients(
                daemon_endpoint, str(run_dir), "batch", batches, 1, None, echo_endpoint
            )
            batch["daemon"].append((result["single"], result["batch"]))
            batch["echo"].append((result["other_single"], result["other_batch"]))
            # Which goes first alternates, so that neither always meets the other's wake.
            for name, endpoint in sorted(targets.items(), reverse=bool(round_no % 2)):
                for n in (1, 2, 4):
                    results = run_clients(endpoint, str(run_dir), "throughput", throughput, n)
                    wall = max(r["seconds"] for r in results)
                    total = sum(r["requests"] for r in results)
                    rps.setdefault((name, n), []).append(total / wall)
            (result,) = run_clients(daemon_endpoint, str(run_dir), "poolclient", pairs, 1)
            client_p50.append(statistics.median(result["times"]))
            if budget_daemon is not None:  # side by side: off, on, off, on...
                (result,) = run_clients(
                    f"ipc://{budget_run_dir}/worker.sock",
                    str(budget_run_dir),
                    "pairs",
                    pairs,
                    1,
                    BENCH_BYTES_PER_BLOCK,
                )
                budget_p50.append(statistics.median(result["times"]))
                (result,) = run_clients(daemon_endpoint, str(run_dir), "pairs", pairs, 1)
                plain_p50.append(statistics.median(result["times"]))
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait()
        if budget_daemon is not None:
            budget_daemon.send_signal(signal.SIGTERM)
            budget_daemon.wait()
        echo.kill()
        echo.wait()
        shutil.rmtree(base, ignore_errors=True)

    def med(values: list[float]) -> float:
        return statistics.median(values)

    def spread(values: list[float], digits: int = 2) -> str:
        """The median of per-round values and their range."""
        return (
            f"{med(values):.{digits}f}x (rounds {min(values):.{digits}f}-{max(values):.{digits}f})"
        )

    us = 1e6
    print("\nallocate(1 block) + free round trip (2 requests)")
    print(f"  {'':8} {'p50 us':>9} {'p99 us':>9}   p50 per round")
    for name in ("echo", "daemon"):
        rounds_us = " ".join(f"{v * us:.0f}" for v in p50[name])
        print(f"  {name:8} {med(p50[name]) * us:9.1f} {med(p99[name]) * us:9.1f}   {rounds_us}")
    ratios = [d / e for d, e in zip(p50["daemon"], p50["echo"], strict=True)]
    print(
        f"  daemon / echo p50: {spread(ratios)} (target <= 1.15x); the daemon adds "
        f"{(med(p50['daemon']) - med(p50['echo'])) * us / 2:.1f} us per request"
    )
    print(
        f"  through PoolClient: p50 {med(client_p50) * us:.1f} us "
        f"({med(client_p50) / med(p50['daemon']):.2f}x the raw daemon round trip)"
    )
    if budget_p50:
        ratio = med(budget_p50) / med(plain_p50)
        print(
            f"  with --budget {args.budget} (sessions declare {BENCH_BYTES_PER_BLOCK} bytes per "
            f"block): p50 {med(budget_p50) * us:.1f} us against {med(plain_p50) * us:.1f} us "
            f"without, measured alternately: {ratio:.3f}x (target <= 1.05x)"
        )
    print("\nrequests/s, allocate+free loops")
    print(f"  {'clients':8} {'echo':>9} {'daemon':>9} {'ratio':>7}")
    for n in (1, 2, 4):
        e, d = med(rps[("echo", n)]), med(rps[("daemon", n)])
        print(f"  {n:<8} {e:9.0f} {d:9.0f} {d / e:7.2f}")
    print("\n64 one-block allocations: 64 allocate calls vs one allocate_many")
    for name in ("echo", "daemon"):
        single = med([s for s, _ in batch[name]])
        batched = med([b for _, b in batch[name]])
        gains = [s / b for s, b in batch[name]]
        print(
            f"  {name:8} 64 calls {single * us:8.0f} us, one message {batched * us:7.0f} us: "
            f"{spread(gains, 1)} the block throughput"
            + (" (target >= 20x)" if name == "daemon" else " (the bound: pure messaging)")
        )


if __name__ == "__main__":
    main()
