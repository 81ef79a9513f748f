#!/usr/bin/env python3
"""How many idle connections vqpoold survives under a given open-file limit, and whether it
still serves afterwards.

Starts vqpoold with RLIMIT_NOFILE set to ``--soft``/``--hard``, opens ``--connections`` idle
connections to its worker socket from a separate process (ZeroMQ DEALERs that handshake and send
nothing, or bare Unix sockets that send nothing at all), holds them ``--hold`` seconds while
sampling the daemon's open files, then closes them and checks that a new client can open a
session. Prints one JSON line: whether the daemon is alive (or the signal that killed it), its
open files at start and at peak, the connections it held, and whether the newcomer got in.

    .venv/bin/python scripts/flood_connections.py --soft 1024 --hard 1024 --connections 1100
    .venv/bin/python scripts/flood_connections.py --soft 256 --hard 256 --kind raw
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import zmq
from vqpool.shared.config import ADMIN_SOCKET_NAME, WORKER_SOCKET_NAME
from vqpool.shared.protocol import decode_reply, encode_request


def flood_main(endpoint: str, n: int, kind: str) -> None:
    """The flooding process: ``n`` idle connections, held until stdin closes."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    with contextlib.suppress(ValueError, OSError):  # each DEALER costs 2 files here
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 2 * n + 256), hard))
    context: zmq.Context[Any] = zmq.Context()
    context.set(zmq.MAX_SOCKETS, n + 16)
    held: list[Any] = []
    path = endpoint.removeprefix("ipc://")
    for _ in range(n):
        if kind == "dealer":
            dealer = context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(endpoint)
            held.append(dealer)
            continue
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.setblocking(False)
        held.append(raw)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                raw.connect(path)
                break
            except BlockingIOError:  # the daemon's backlog is full: wait for its accepts
                time.sleep(0.001)
            except OSError:  # refused (path hidden or gone)
                break
    print("flooding", flush=True)
    sys.stdin.read()
    for item in held:
        item.close(**({"linger": 0} if kind == "dealer" else {}))
    context.term()


def new_session_opens(run_dir: Path, timeout: float) -> bool:
    context: zmq.Context[Any] = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"ipc://{run_dir / WORKER_SOCKET_NAME}")
    args = {"pid": os.getpid(), "model": "flood-probe", "nonce": os.urandom(8).hex()}
    dealer.send(encode_request(1, "hello", args, None, None))
    try:
        return bool(dealer.poll(int(timeout * 1000)) and decode_reply(dealer.recv())["ok"])
    finally:
        dealer.close(linger=0)
        context.term()


def probe(args: argparse.Namespace) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="vqflood", dir="/tmp"))
    run_dir = base / "run"
    limits = (args.soft, args.hard)
    daemon = subprocess.Popen(
        [sys.executable, "-m", "vqpool.daemon", "--run-dir", str(run_dir), "--n-blocks", "64"],
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, limits),
    )
    try:
        assert daemon.stderr is not None
        start_line = ""
        while "listening" not in start_line:  # a low-limit warning may come first
            start_line = daemon.stderr.readline()
            if not start_line:
                raise RuntimeError(f"vqpoold exited with {daemon.wait()}")
        while not (run_dir / ADMIN_SOCKET_NAME).exists():
            time.sleep(0.01)
        process = psutil.Process(daemon.pid)
        start_fds = peak_fds = process.num_fds()
        sampling = True

        def sample() -> None:
            nonlocal peak_fds
            while sampling:
                with contextlib.suppress(psutil.Error):
                    peak_fds = max(peak_fds, process.num_fds())
                time.sleep(0.0005)

        sampler = threading.Thread(target=sample)
        sampler.start()
        endpoint = f"ipc://{run_dir / WORKER_SOCKET_NAME}"
        flood = subprocess.Popen(
            [sys.executable, __file__, "--flood", endpoint, str(args.connections), args.kind],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert flood.stdout is not None and flood.stdin is not None
        flood.stdout.readline()
        time.sleep(args.hold)
        alive = daemon.poll() is None
        held = process.num_fds() - start_fds if alive else None
        flood.stdin.close()
        flood.wait()
        newcomer = new_session_opens(run_dir, 5.0) if daemon.poll() is None else False
        sampling = False
        sampler.join()
        killed_by = None
        if daemon.poll() is not None and daemon.returncode < 0:
            killed_by = signal.Signals(-daemon.returncode).name
        return {
            "fd_limit": f"{args.soft}/{args.hard}",
            "flood": f"{args.connections} {args.kind}",
            "alive": daemon.poll() is None,
            "killed_by": killed_by,
            "start_fds": start_fds,
            "peak_fds": peak_fds,
            "connections_held": held,
            "newcomer_hello": newcomer,
            "start_line_tail": start_line.rsplit(";", 1)[-1].strip(),
        }
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
        daemon.wait(10)
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--flood":
        flood_main(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--soft", type=int, default=1024, help="daemon's soft RLIMIT_NOFILE")
    parser.add_argument("--hard", type=int, default=1024, help="daemon's hard RLIMIT_NOFILE")
    parser.add_argument("--connections", type=int, default=1100, help="idle connections")
    parser.add_argument("--kind", choices=["dealer", "raw"], default="dealer")
    parser.add_argument("--hold", type=float, default=3.0, help="seconds to hold the flood")
    print(json.dumps(probe(parser.parse_args())))


if __name__ == "__main__":
    main()
