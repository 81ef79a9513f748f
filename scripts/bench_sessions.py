#!/usr/bin/env python3
"""What many sessions cost vqpoold: opening them, the bounds, and the daemon idle with them open.

Client processes say hello in a loop on a real ``vqpoold`` (one after the other, so the figure
is the daemon's, not process start-up) until they are refused, and keep their sessions open.
Reported:

* sessions accepted per process and in total before TOO_MANY_SESSIONS, and the refusal;
* hello round trips: median, and the total time to open every session up to the bound;
* with every session open: the daemon's CPU while idle (its liveness tick every 0.25 s), the
  admin ping round trip (median), and the entries of the roll (workers.json).

    scripts/bench_sessions.py              # up to the bound: 17 processes
    scripts/bench_sessions.py --idle 10    # measure idle CPU over 10 s
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil
from vqpool.daemon.core.claims import ROLL_FILE_NAME
from vqpool.daemon.core.sessions import MAX_SESSIONS, MAX_SESSIONS_PER_PROCESS
from vqpool.shared.admin_client import AdminClient
from vqpool.shared.config import WORKER_SOCKET_NAME
from vqpool.worker.testing.launch import DaemonProcess

# Opens sessions until refused or ``limit`` tries, prints hello round trips (seconds) and the
# refusal as one JSON line, then keeps the sessions open until its stdin closes.
OPENER = textwrap.dedent(
    """
    import json, os, sys, time
    import zmq
    from vqpool.shared.protocol import decode_reply, encode_request
    sock = zmq.Context().socket(zmq.DEALER)
    sock.connect(sys.argv[1])
    times, refusal = [], None
    for n in range(int(sys.argv[2])):
        args = {"pid": os.getpid(), "model": "bench", "nonce": f"{os.getpid()}-{n}"}
        started = time.perf_counter()
        sock.send(encode_request(n + 1, "hello", args))
        reply = decode_reply(sock.recv())
        if not reply["ok"]:
            refusal = reply["error"]
            break
        times.append(time.perf_counter() - started)
    print(json.dumps({"times": times, "refusal": refusal}), flush=True)
    sys.stdin.read()
    """
)


def open_sessions(endpoint: str, tries: int) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """A process that opened sessions (kept open), and its report."""
    opener = subprocess.Popen(
        [sys.executable, "-c", OPENER, endpoint, str(tries)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert opener.stdout is not None
    return opener, json.loads(opener.stdout.readline())


def idle_cpu(pid: int, seconds: float) -> float:
    """The daemon's CPU use over ``seconds`` of idleness, in percent of one core."""
    process = psutil.Process(pid)
    before = process.cpu_times()
    time.sleep(seconds)
    after = process.cpu_times()
    used = (after.user - before.user) + (after.system - before.system)
    return 100 * used / seconds


def ping_us(run_dir: Path, n: int) -> float:
    """Median admin ping round trip, in microseconds."""
    times = []
    with AdminClient(run_dir, timeout=5.0) as admin:
        for _ in range(n):
            started = time.perf_counter()
            admin.call("ping")
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle", type=float, default=5.0, help="seconds of idle CPU measured")
    parser.add_argument("--pings", type=int, default=200, help="admin pings measured")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="vqbs", dir="/tmp"))
    run_dir = base / "run"
    daemon = DaemonProcess(run_dir, "--log-level", "WARNING").start()
    endpoint = f"ipc://{run_dir / WORKER_SOCKET_NAME}"
    openers: list[subprocess.Popen[str]] = []
    try:
        cpu_empty = idle_cpu(daemon.pid, args.idle)
        ping_empty = ping_us(run_dir, args.pings)
        reports = []
        n_processes = MAX_SESSIONS // MAX_SESSIONS_PER_PROCESS + 1
        for _ in range(n_processes):
            opener, report = open_sessions(endpoint, MAX_SESSIONS_PER_PROCESS + 1)
            openers.append(opener)
            reports.append(report)
        hellos = [t for report in reports for t in report["times"]]
        time.sleep(0.5)  # a tick or two: the roll is written once per tick when it changed
        roll = json.loads((run_dir / ROLL_FILE_NAME).read_text())
        cpu_full = idle_cpu(daemon.pid, args.idle)
        ping_full = ping_us(run_dir, args.pings)
        refusals = [report["refusal"] for report in reports]
        print(
            json.dumps(
                {
                    "bounds": {"per_process": MAX_SESSIONS_PER_PROCESS, "total": MAX_SESSIONS},
                    "accepted_per_process": [len(report["times"]) for report in reports],
                    "accepted_total": len(hellos),
                    "first_refusal": refusals[0],
                    "last_refusal": refusals[-1],
                    "hello_median_us": round(statistics.median(hellos) * 1e6, 1),
                    "hello_p99_us": round(sorted(hellos)[int(len(hellos) * 0.99)] * 1e6, 1),
                    "hello_first_of_process_us": [
                        round(r["times"][0] * 1e6) for r in reports if r["times"]
                    ],
                    "hello_total_s": round(sum(hellos), 4),
                    "roll_entries": len(roll),
                    "idle_cpu_percent": {"no_session": cpu_empty, "all_open": cpu_full},
                    "admin_ping_median_us": {"no_session": ping_empty, "all_open": ping_full},
                },
                indent=1,
            )
        )
    finally:
        for opener in openers:
            opener.communicate()
        daemon.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
