#!/usr/bin/env python3
"""How much a flood of cached error replies grows a real vqpoold (issue 10, finding 4).

A "holder" session (model name of 256 chars) registers 4,096 owners with 128-char names; an
"attacker" session then sends 64 allocate_many requests of 4,096 items naming those owners. Every
item fails with OWNER_ALREADY_ACTIVE and every reply is kept in the attacker's reply cache. The
daemon's RSS (psutil) is read before and after the 64 replies.

    scripts/reply_flood.py                # distinct owners: each item's message differs
    scripts/reply_flood.py --same-owner   # one owner named 4,096 times: one reason throughout

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
N_REPLIES = 64


class Session:
    """One raw protocol session on a DEALER."""

    def __init__(
        self, context: zmq.Context[Any], endpoint: str, model: str, **hello_args: Any
    ) -> None:
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.rid = 0
        self.sid: int | None = None
        self.boot: str | None = None
        nonce = os.urandom(8).hex()
        hello = self.call(
            "hello", {"pid": os.getpid(), "model": model, "nonce": nonce, **hello_args}
        )
        self.sid, self.boot = hello["result"]["sid"], hello["result"]["boot"]

    def call_raw(self, op: str, args: dict[str, Any]) -> bytes:
        self.rid += 1
        self.socket.send(encode_request(self.rid, op, args, self.sid, self.boot))
        if not self.socket.poll(30_000):
            raise TimeoutError(f"{op}: no reply in 30 s")
        return bytes(self.socket.recv())

    def call(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        reply: dict[str, Any] = msgpack.unpackb(self.call_raw(op, args))
        return reply


def wait_for_socket(run_dir: Path, daemon: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 15
    while not (run_dir / "worker.sock").exists():
        if daemon.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("vqpoold did not start")
        time.sleep(0.05)
    time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--same-owner", action="store_true", help="one owner, named 4,096 times")
    options = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="vqflood", dir="/tmp"))
    run_dir = base / "run"
    daemon = subprocess.Popen(
        [sys.executable, "-m", "vqpool.daemon", "--run-dir", str(run_dir), "--n-blocks", "256"],
        stderr=subprocess.DEVNULL,
    )
    context: zmq.Context[Any] = zmq.Context()
    try:
        wait_for_socket(run_dir, daemon)
        endpoint = f"ipc://{run_dir / 'worker.sock'}"
        holder = Session(context, endpoint, "m" * 256)
        attacker = Session(context, endpoint, "attacker")
        n_owners = 1 if options.same_owner else N_ITEMS
        owners = [f"{i:04d}".ljust(128, "o") for i in range(n_owners)]
        for owner in owners:
            assert holder.call("register_owner", {"owner": owner})["ok"]
        items = [["k", 16, owners[i % n_owners], "fp16"] for i in range(N_ITEMS)]
        process = psutil.Process(daemon.pid)
        rss_before = process.memory_info().rss
        sizes = [
            len(attacker.call_raw("allocate_many", {"items": items})) for _ in range(N_REPLIES)
        ]
        rss_after = process.memory_info().rss
        kind = "one owner" if options.same_owner else "distinct owners"
        print(
            f"{N_REPLIES} replies of {N_ITEMS} failed items ({kind}): "
            f"reply {sizes[-1] / 1024:.0f} KiB, {sum(sizes) / 2**20:.1f} MiB sent; "
            f"daemon RSS {rss_before / 2**20:.1f} -> {rss_after / 2**20:.1f} MiB "
            f"(+{(rss_after - rss_before) / 2**20:.1f} MiB)"
        )
    finally:
        context.destroy(linger=0)
        daemon.terminate()
        daemon.wait(10)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
