#!/usr/bin/env python3
"""Whether ``vqpool serve`` keeps serving while one local client floods it with idle or slow
connections, and whether its memory and open files stay bounded.

Starts a real ``vqpool serve --model builtin:llama`` (tests/front_harness.py), loads the model,
then, for the chosen kind, opens ``--connections`` connections from this process and holds them
``--hold`` seconds while timing a normal completion from another connection every second and
sampling the front door's RSS and open files. Kinds: ``idle`` (connect, send nothing),
``slowloris`` (a request line, then one header byte every ``--drip`` seconds), ``body`` (a POST
head with Content-Length 8 MiB, then one body byte every ``--drip`` seconds), ``unread`` (one
streamed completion of many tokens whose answer is never read). Prints one JSON line: the
completion latencies, peak RSS and open files, and how many flood connections the server had
closed by the end (and when the first and last closed); for ``unread``, the front door's open
TCP connections at the end (2 while it still streams to the client from the worker).

    .venv/bin/python scripts/flood_front_door.py --kind idle --connections 2000
    .venv/bin/python scripts/flood_front_door.py --kind slowloris --hold 40 -- --head-timeout 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import socket
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from front_harness import FrontDoor

BODY_SIZE = 8 * 1024 * 1024
MODEL = "builtin:llama"


def raise_own_fd_limit(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, n + 256)), hard))


def open_flood(host: str, port: int, n: int, kind: str) -> list[socket.socket]:
    held = []
    for _ in range(n):
        sock = socket.create_connection((host, port), timeout=5)
        sock.setblocking(False)
        if kind == "slowloris":
            sock.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        elif kind == "body":
            head = (
                "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {BODY_SIZE}\r\n\r\n"
            )
            sock.send(head.encode() + b"{")
        held.append(sock)
    return held


def drip(held: list[socket.socket], closed_at: dict[int, float], start: float) -> None:
    """One byte to each open flood connection; note the ones the server closed."""
    for i, sock in enumerate(held):
        if i in closed_at:
            continue
        try:
            data = sock.recv(4096)
            if data == b"" or data:  # EOF, or an answer (a refusal): the server is done with it
                closed_at[i] = time.monotonic() - start
                continue
        except BlockingIOError:
            pass
        except OSError:
            closed_at[i] = time.monotonic() - start
            continue
        with contextlib.suppress(BlockingIOError):
            try:
                sock.send(b"x")
            except OSError:
                closed_at[i] = time.monotonic() - start


def unread_stream(host: str, port: int) -> socket.socket:
    body = json.dumps(
        # 20 alternatives per token: ~2 KiB an event, so the socket buffers fill in seconds.
        {"model": MODEL, "prompt": "hello", "max_tokens": 30000, "stream": True, "logprobs": 20}
    ).encode()
    sock = socket.create_connection((host, port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    sock.setblocking(False)
    return sock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=["idle", "slowloris", "body", "unread"], required=True)
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--hold", type=float, default=30.0)
    parser.add_argument("--drip", type=float, default=3.0)
    parser.add_argument("serve_args", nargs="*", help="more vqpool serve options (after --)")
    args = parser.parse_args()
    raise_own_fd_limit(args.connections)
    with FrontDoor("--model", MODEL, *args.serve_args) as front:
        assert front.complete(MODEL).status == 200
        parts = urlsplit(front.url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        process = psutil.Process(front.pid)
        base_rss, base_fds = process.memory_info().rss, process.num_fds()
        start = time.monotonic()
        if args.kind == "unread":
            held = [unread_stream(host, port)]
        else:
            held = open_flood(host, port, args.connections, args.kind)
        opened_s = time.monotonic() - start
        latencies: list[float | str] = []
        peak_rss, peak_fds = base_rss, base_fds
        closed_at: dict[int, float] = {}
        next_drip = time.monotonic()
        while time.monotonic() - start < args.hold:
            if args.kind in ("slowloris", "body") and time.monotonic() >= next_drip:
                drip(held, closed_at, start)
                next_drip += args.drip
            elif args.kind == "idle":
                drip_check(held, closed_at, start)
            t0 = time.monotonic()
            try:
                reply = front.complete(MODEL, max_tokens=2)
                latencies.append(
                    round(time.monotonic() - t0, 3) if reply.status == 200 else str(reply.status)
                )
            except OSError as exc:
                latencies.append(type(exc).__name__)
            peak_rss = max(peak_rss, process.memory_info().rss)
            peak_fds = max(peak_fds, process.num_fds())
            time.sleep(1.0)
        unread_open = established(process) if args.kind == "unread" else None
        for sock in held:
            sock.close()
        worker_children = front.children()
        result: dict[str, Any] = {
            "kind": args.kind,
            "connections": len(held),
            "opened_in_s": round(opened_s, 2),
            "serve_args": args.serve_args,
            "completion_s": latencies,
            "rss_mib": [round(base_rss / 2**20, 1), round(peak_rss / 2**20, 1)],
            "fds": [base_fds, peak_fds],
            "closed_by_server": len(closed_at),
            "first_closed_s": round(min(closed_at.values()), 1) if closed_at else None,
            "last_closed_s": round(max(closed_at.values()), 1) if closed_at else None,
            "children": len(worker_children),
            "open_connections_at_end": unread_open,
        }
        print(json.dumps(result), flush=True)


def established(process: psutil.Process) -> int:
    """The front door's open TCP connections: clients' and to its workers."""
    return sum(1 for c in process.net_connections("tcp") if c.status == "ESTABLISHED")


def drip_check(held: list[socket.socket], closed_at: dict[int, float], start: float) -> None:
    """Note the flood connections the server closed (without sending anything)."""
    for i, sock in enumerate(held):
        if i in closed_at:
            continue
        try:
            while sock.recv(65536):
                pass
            closed_at[i] = time.monotonic() - start
        except BlockingIOError:
            pass
        except OSError:
            closed_at[i] = time.monotonic() - start


if __name__ == "__main__":
    main()
