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
import os
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
from vqpool.shared.protocol import encode_request

N_ITEMS = 4096
N_SESSIONS = 4
PER_SESSION = 64
BLOCK = 16


class Session:
    """One raw protocol session on a DEALER, with declared bytes per block."""

    def __init__(self, context: zmq.Context[Any], endpoint: str, model: str, bpb: int) -> None:
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.rid = 0
        self.sid: int | None = None
        self.boot: str | None = None
        hello = self.call(
            "hello",
            {
                "pid": os.getpid(),
                "model": model,
                "nonce": os.urandom(8).hex(),
                "bytes_per_block": bpb,
            },
        )
        assert hello["ok"], hello
        self.sid, self.boot = hello["result"]["sid"], hello["result"]["boot"]

    def send(self, op: str, args: dict[str, Any]) -> None:
        self.rid += 1
        self.socket.send(encode_request(self.rid, op, args, self.sid, self.boot))

    def recv(self, timeout: float = 30.0) -> dict[str, Any]:
        if not self.socket.poll(int(timeout * 1000)):
            raise TimeoutError(f"no reply in {timeout} s")
        reply: dict[str, Any] = msgpack.unpackb(self.socket.recv())
        return reply

    def call(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        self.send(op, args)
        return self.recv()

    def replies_now(self) -> list[dict[str, Any]]:
        found = []
        while self.socket.poll(0):
            found.append(msgpack.unpackb(self.socket.recv()))
        return found


def victim(endpoint: str) -> None:
    """Another process: one waiting allocate of another model; print what it got."""
    context: zmq.Context[Any] = zmq.Context()
    session = Session(context, endpoint, "victim", 1000)
    args = {"stream": "k", "n_tokens": BLOCK, "owner": "v", "wait": 0.5}
    start = time.monotonic()
    reply = session.call("allocate", args)
    took = time.monotonic() - start
    message = "granted" if reply["ok"] else reply["error"]["message"]
    print(f"another process's waiting request, answered after {took:.2f} s: {message[:110]}")
    context.destroy(linger=0)


def wait_for_socket(run_dir: Path, daemon: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 15
    while not (run_dir / "worker.sock").exists():
        if daemon.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("vqpoold did not start")
        time.sleep(0.05)
    time.sleep(0.2)


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
    run_dir = base / "run"
    daemon = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vqpool.daemon",
            "--run-dir",
            str(run_dir),
            "--n-blocks",
            "512",
            "--budget",
            str(8 * 10**6),
        ],
        stderr=subprocess.DEVNULL,
    )
    context: zmq.Context[Any] = zmq.Context()
    try:
        wait_for_socket(run_dir, daemon)
        endpoint = f"ipc://{run_dir / 'worker.sock'}"
        holder = Session(context, endpoint, "holder", 100_000)
        args = {"stream": "k", "n_tokens": 80 * BLOCK, "owner": "h", "wait": 0.0}
        assert holder.call("allocate", args)["ok"]
        sessions = [Session(context, endpoint, f"name-{m}", 1000) for m in range(N_SESSIONS)]
        process = psutil.Process(daemon.pid)
        rss_before = process.memory_info().rss
        for n in range(options.per_session):
            for m, session in enumerate(sessions):
                items = [
                    ["k", BLOCK, f"{m}-{n}-{i}-".ljust(128, "o"), "fp16"]
                    for i in range(options.items)
                ]
                session.send("allocate_many", {"items": items, "wait": 30.0})
        time.sleep(2.0)  # let the daemon take them all in
        refusals = [r for s in sessions for r in s.replies_now() if not r["ok"]]
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
        daemon.terminate()
        daemon.wait(10)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
