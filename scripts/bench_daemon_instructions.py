#!/usr/bin/env python3
"""Instructions vqpoold spends per request, counted by callgrind (the daemon side only).

Wall-clock figures on a shared machine swing with the neighbours' load; an instruction count
does not. One vqpoold runs under ``valgrind --tool=callgrind``; a client (not under valgrind)
says hello, warms up, then for each measurement zeroes the daemon's counters
(``callgrind_control -z``), sends a short and then a long run of requests, dumping the counters
after each (``callgrind_control -d``): the difference over the extra iterations is the count
per iteration (the zero/dump and idle loop turns cancel out). Needs valgrind.

Measured: allocate(1 block) + free (two requests), 64 allocate calls, and one allocate_many of
64 one-block items (each followed by one free of what it got).

    scripts/bench_daemon_instructions.py            # 200 and 1,000 iterations
    scripts/bench_daemon_instructions.py --quick    # 50 and 250
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_daemon import Session, daemon_argv
from vqpool.shared.admin_client import AdminClient
from vqpool.shared.errors import DaemonUnavailableError


def pair(session: Session) -> None:
    reply = session.call("allocate", {"stream": "k", "n_tokens": 1, "owner": 1})
    session.call("free", {"block_ids": reply["result"]})


def singles(session: Session) -> None:
    ids: list[int] = []
    for i in range(64):
        ids += session.call("allocate", {"stream": "k", "n_tokens": 1, "owner": i})["result"]
    session.call("free", {"block_ids": ids})


def batch(session: Session) -> None:
    items = [["k", 1, i, "fp16"] for i in range(64)]
    result = session.call("allocate_many", {"items": items})["result"]
    session.call("free", {"block_ids": [bid for ids in result for bid in ids]})


MEASUREMENTS = {
    "allocate(1)+free pair": (pair, 1),
    "64 allocate + free": (singles, 16),
    "allocate_many(64) + free": (batch, 1),
}
"""Name: (one iteration, how many times fewer iterations it runs)."""


def dump_total(pid: int, out: Path) -> int:
    """Dump the daemon's counters; the instructions since the last zero."""
    before = set(out.parent.glob(out.name + "*"))
    subprocess.run(["callgrind_control", "-d", str(pid)], capture_output=True, check=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        new = set(out.parent.glob(out.name + "*")) - before
        for path in new:
            text = path.read_text()
            found = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
            if found:
                return int(found.group(1))
        time.sleep(0.1)
    raise RuntimeError("callgrind wrote no dump")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs")
    args = parser.parse_args()
    short, long = (50, 250) if args.quick else (200, 1_000)
    with tempfile.TemporaryDirectory(prefix="vqpool-bench-") as tmp:
        run_dir = Path(tmp) / "run"
        out = Path(tmp) / "callgrind.out"
        daemon = subprocess.Popen(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                *daemon_argv(run_dir),
            ],
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    with AdminClient(run_dir, timeout=2) as admin:
                        admin.call("ping")
                    break
                except DaemonUnavailableError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
            session = Session(f"ipc://{run_dir}/worker.sock")
            print(f"instructions per iteration in vqpoold ({long:,} minus {short:,} iterations)")
            for name, (step, scale) in MEASUREMENTS.items():
                n_short, n_long = max(1, short // scale), max(2, long // scale)
                for _ in range(n_short):
                    step(session)  # warm up
                totals = []
                for n in (n_short, n_long):
                    subprocess.run(
                        ["callgrind_control", "-z", str(daemon.pid)],
                        capture_output=True,
                        check=True,
                    )
                    for _ in range(n):
                        step(session)
                    totals.append(dump_total(daemon.pid, out))
                per = (totals[1] - totals[0]) / (n_long - n_short)
                print(f"  {name:<28}{per:>14,.0f}", flush=True)
        finally:
            daemon.terminate()
            daemon.wait(timeout=120)


if __name__ == "__main__":
    main()
