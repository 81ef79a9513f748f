#!/usr/bin/env python3
"""How much a flood of waiting requests grows a real vqpoold, and whether others still wait
(issue 23, finding 11).

A "holder" session takes the whole budget, so every other allocation waits. One process then
opens 4 sessions under 4 model names and sends 256 ``allocate_many`` of 4,096 items with
128-character owners, each with ``wait`` 30 s (64 per session), reading no reply. The daemon's
RSS (psutil) is read before and after; then a request of another model, from another process,
asks with ``wait`` 0.5 s: queued (answered POOL_EXHAUSTED "waited ...") or refused at once.

    scripts/waiting_flood.py                                # 256 requests of 4,096 items
    scripts/waiting_flood.py --per-session 256 --items 64   # 1,024 small ones: the global cap

It speaks protocol v1 with a bare DEALER and reads nothing from the daemon but replies, its pid
and RSS, so the same script measures any revision of vqpoold on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import psutil
import zmq
from reply_flood import Session
from vqpool.shared.protocol import encode_request
from vqpool.worker.testing.launch import DaemonProcess

N_ITEMS = 4096
N_SESSIONS = 4
PER_SESSION = 64
BLOCK = 16


def replies_now(session: Session) -> list[dict[str, Any]]:
    """The replies ``session`` has received so far, without waiting."""
    found = []
    while session.socket.poll(0):
        found.append(msgpack.unpackb(session.socket.recv()))
    return found


def send(session: Session, op: str, args: dict[str, Any]) -> None:
    """Send a request without reading its reply."""
    session.rid += 1
    session.socket.send(encode_request(session.rid, op, args, session.sid, session.boot))


def victim(endpoint: str) -> None:
    """Another process: one waiting allocate of another model; print what it got."""
    context: zmq.Context[Any] = zmq.Context()
    session = Session(context, endpoint, "victim", bytes_per_block=1000)
    args = {"stream": "k", "n_tokens": BLOCK, "owner": "v", "wait": 0.5}
    start = time.monotonic()
    reply = session.call("allocate", args)
    took = time.monotonic() - start
    message = "granted" if reply["ok"] else reply["error"]["message"]
    print(f"another process's waiting request, answered after {took:.2f} s: {message[:110]}")
    context.destroy(linger=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--victim", metavar="ENDPOINT", help=argparse.SUPPRESS)
    parser.add_argument("--per-session", type=int, default=PER_SESSION, help="requests each")
    parser.add_argument("--items", type=int, default=N_ITEMS, help="items per request")
    options = parser.parse_args()
    if options.victim:
        victim(options.victim)
        return
    base = Path(tempfile.mkdtemp(prefix="vqwait", dir="/tmp"))
    daemon = DaemonProcess(base / "run", "--n-blocks", "512", "--budget", str(8 * 10**6))
    context: zmq.Context[Any] = zmq.Context()
    try:
        daemon.start()
        endpoint = f"ipc://{daemon.run_dir / 'worker.sock'}"
        holder = Session(context, endpoint, "holder", bytes_per_block=100_000)
        args = {"stream": "k", "n_tokens": 80 * BLOCK, "owner": "h", "wait": 0.0}
        assert holder.call("allocate", args)["ok"]
        sessions = [
            Session(context, endpoint, f"name-{m}", bytes_per_block=1000) for m in range(N_SESSIONS)
        ]
        process = psutil.Process(daemon.pid)
        rss_before = process.memory_info().rss
        for n in range(options.per_session):
            for m, session in enumerate(sessions):
                items = [
                    ["k", BLOCK, f"{m}-{n}-{i}-".ljust(128, "o"), "fp16"]
                    for i in range(options.items)
                ]
                send(session, "allocate_many", {"items": items, "wait": 30.0})
        time.sleep(2.0)  # let the daemon take them all in
        refusals = [r for s in sessions for r in replies_now(s) if not r["ok"]]
        rss_after = process.memory_info().rss
        n_sent = options.per_session * N_SESSIONS
        print(
            f"{n_sent} waiting allocate_many of {options.items} items (128-char owners) from one "
            f"process, {N_SESSIONS} sessions: {n_sent - len(refusals)} queued, "
            f"{len(refusals)} refused; daemon RSS {rss_before / 2**20:.1f} -> "
            f"{rss_after / 2**20:.1f} MiB (+{(rss_after - rss_before) / 2**20:.1f} MiB)"
        )
        if refusals:
            print(f"  first refusal: {refusals[0]['error']['message'][:140]}")
        subprocess.run([sys.executable, __file__, "--victim", endpoint], check=True)
    finally:
        context.destroy(linger=0)
        daemon.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
