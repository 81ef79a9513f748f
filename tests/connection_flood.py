"""A process that floods a vqpoold socket with idle connections, for the fd-limit tests.

Run as ``python connection_flood.py ENDPOINT N KIND``: opens N connections to ``ENDPOINT`` (an
``ipc://`` path) that send nothing of their own, prints ``flooding`` once every connect was
started, and holds them until stdin closes. KIND ``dealer`` uses ZeroMQ DEALER sockets (they
complete the handshake and keep reconnecting when refused); ``raw`` uses bare Unix sockets that
never send a byte (each waits while the daemon's backlog is full). The process raises its own
soft open-file limit first.
"""

from __future__ import annotations

import contextlib
import resource
import socket
import sys
import time
from typing import Any

import zmq

RAW_CONNECT_PATIENCE = 5.0


def raise_own_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for target in (hard, 10240):  # macOS refuses RLIM_INFINITY: OPEN_MAX is the usual cap
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, target), hard))
            return


def connect_raw(raw: socket.socket, path: str) -> None:
    """Connect, waiting while the listener's backlog is full; give up once the path is refused
    (gone or hidden) or after a few seconds."""
    raw.setblocking(False)
    deadline = time.monotonic() + RAW_CONNECT_PATIENCE
    while time.monotonic() < deadline:
        try:
            raw.connect(path)
            return
        except BlockingIOError:  # backlog full: the daemon has not accepted the queued ones yet
            time.sleep(0.001)
        except OSError:
            return


def main(endpoint: str, n: int, kind: str) -> None:
    raise_own_fd_limit()
    path = endpoint.removeprefix("ipc://")
    context: zmq.Context[Any] = zmq.Context()
    context.set(zmq.MAX_SOCKETS, n + 16)
    dealers: list[zmq.Socket[bytes]] = []
    raws: list[socket.socket] = []
    for _ in range(n):
        if kind == "dealer":
            sock: zmq.Socket[bytes] = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            dealers.append(sock)
        else:
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            raws.append(raw)
            connect_raw(raw, path)
    print("flooding", flush=True)
    sys.stdin.read()
    for sock in dealers:
        sock.close(linger=0)
    for raw in raws:
        raw.close()
    context.term()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
