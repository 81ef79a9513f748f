"""vqpool serve under connection floods from one local client, through real processes: idle,
slow-head (slowloris) and slow-body connections do not stop it serving another client, and it
closes them at its deadlines; past its connection cap the oldest idle connections are closed,
and when every connection has a request in progress a newcomer gets a 503."""

from __future__ import annotations

import contextlib
import json
import resource
import selectors
import socket
import time
from collections.abc import Iterator, Sequence
from urllib.parse import urlsplit

import psutil
from daemon_harness import wait_until
from front_harness import FrontDoor

MODEL = "builtin:llama"
HEAD_TIMEOUT = 5.0
BODY_TIMEOUT = 5.0
IDLE = 1000
SLOW_HEADS = 200
SLOW_BODIES = 50
DEADLINE_SLACK = 6.0
"""Seconds past a deadline a flood connection may still be open (two busy CPUs)."""


@contextlib.contextmanager
def own_fd_limit(wanted: int) -> Iterator[None]:
    """This test process's soft open-file limit raised to ``wanted`` (within its hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY:
        assert hard >= wanted, f"the hard open-file limit {hard} is below {wanted}"
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def address(front: FrontDoor) -> tuple[str, int]:
    parts = urlsplit(front.url)
    assert parts.hostname and parts.port
    return parts.hostname, parts.port


def connect(front: FrontDoor, first_bytes: bytes = b"") -> socket.socket:
    sock = socket.create_connection(address(front), timeout=10)
    sock.sendall(first_bytes)
    sock.setblocking(False)
    return sock


def client_connections(front: FrontDoor) -> int:
    """The front door's open connections on its port."""
    port = address(front)[1]
    connections = psutil.Process(front.pid).net_connections(kind="tcp")
    return sum(1 for c in connections if c.laddr.port == port and c.status == "ESTABLISHED")


def slow_body_head(length: int) -> bytes:
    return (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n{{"
    ).encode()


def wait_closed_by_server(
    socks: list[socket.socket],
    deadline: float,
    drip: Sequence[socket.socket] = (),
    leave_open: int = 0,
) -> dict[socket.socket, bytes]:
    """Read the sockets until the server has closed all but ``leave_open`` of them, sending one
    byte to each of ``drip`` every half second meanwhile; what each closed one received.
    AssertionError if more are open at ``deadline`` (``time.monotonic()``)."""
    received = {sock: b"" for sock in socks}
    selector = selectors.DefaultSelector()
    for sock in socks:
        selector.register(sock, selectors.EVENT_READ)
    open_now = set(socks)
    next_drip = time.monotonic()
    while len(open_now) > leave_open and time.monotonic() < deadline:
        if time.monotonic() >= next_drip:
            for sock in drip:
                if sock in open_now:
                    with contextlib.suppress(OSError):
                        sock.send(b"x")
            next_drip += 0.5
        for key, _ in selector.select(timeout=0.1):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                continue
            except ConnectionResetError:
                data = b""
            if data:
                received[sock] += data
            else:
                open_now.discard(sock)
                selector.unregister(sock)
    selector.close()
    assert len(open_now) <= leave_open, f"{len(open_now)} of {len(socks)} connections open"
    return {sock: data for sock, data in received.items() if sock not in open_now}


def test_idle_and_slow_connections_neither_stop_serving_nor_stay_open():
    flood = IDLE + SLOW_HEADS + SLOW_BODIES
    bounds = ("--head-timeout", str(HEAD_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT))
    with own_fd_limit(flood + 256), FrontDoor("--model", MODEL, *bounds) as front:
        assert front.complete(MODEL).status == 200  # loaded: what follows times no load
        started = time.monotonic()
        idle = [connect(front) for _ in range(IDLE)]
        slow_heads = [
            connect(front, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            for _ in range(SLOW_HEADS)
        ]
        slow_bodies = [connect(front, slow_body_head(8 * 1024 * 1024)) for _ in range(SLOW_BODIES)]
        flooders = idle + slow_heads + slow_bodies
        try:
            wait_until(lambda: client_connections(front) >= flood, timeout=HEAD_TIMEOUT)

            asked = time.monotonic()
            reply = front.complete(MODEL, max_tokens=2)
            assert reply.status == 200, reply.body
            assert time.monotonic() - asked < HEAD_TIMEOUT  # served while every flooder is open

            received = wait_closed_by_server(
                flooders,
                deadline=started + max(HEAD_TIMEOUT, BODY_TIMEOUT) + DEADLINE_SLACK,
                drip=slow_heads + slow_bodies,
            )
            assert time.monotonic() - started >= min(HEAD_TIMEOUT, BODY_TIMEOUT) - 0.5
            for sock in idle + slow_heads:
                assert received[sock] == b""  # closed, no answer: no request was made
            for sock in slow_bodies:
                assert received[sock].startswith(b"HTTP/1.1 408 "), received[sock][:200]
                error = json.loads(received[sock].split(b"\r\n\r\n", 1)[1])["error"]
                assert f"within {BODY_TIMEOUT:g} s" in error["message"]
            wait_until(lambda: client_connections(front) == 0, timeout=5)
            assert front.complete(MODEL).status == 200
        finally:
            for sock in flooders:
                sock.close()


def test_past_the_cap_the_oldest_idle_connections_close_and_busy_ones_make_a_503():
    cap = 4  # the worker's --max-concurrent: every stream below decodes at once
    flood = 300
    with (
        own_fd_limit(flood + 256),
        FrontDoor("--model", MODEL, "--max-connections", str(cap)) as front,
    ):
        assert front.complete(MODEL).status == 200
        idle = [connect(front) for _ in range(flood)]
        try:
            # Closed: the oldest idle ones; refused (a 503, then closed): those accepted in one
            # burst with cap-many others not connected yet, which count and cannot be closed.
            closed = wait_closed_by_server(idle, deadline=time.monotonic() + 10, leave_open=cap)
            assert idle[0] in closed and closed[idle[0]] == b""
            for answer in closed.values():
                assert answer == b"" or answer.startswith(b"HTTP/1.1 503 "), answer[:200]
            assert client_connections(front) <= cap
            assert front.complete(MODEL, max_tokens=2).status == 200  # one more idle one closed
        finally:
            for sock in idle:
                sock.close()

        # Every connection with a request in progress (a stream whose answer has begun).
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 30000, "stream": True})
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        wait_until(lambda: client_connections(front) == 0, timeout=10)
        streams = [connect(front, head.encode() + body.encode()) for _ in range(cap)]
        try:
            for sock in streams:
                sock.setblocking(True)
                assert sock.recv(65536).startswith(b"HTTP/1.1 200 OK\r\n")
            refused = front.complete(MODEL)
            assert refused.status == 503, refused.body
            assert refused.headers["retry-after"] == "1"
            assert refused.body["error"]["type"] == "overloaded"
        finally:
            for sock in streams:
                sock.close()
        wait_until(lambda: front.complete(MODEL, max_tokens=2).status == 200, timeout=20)
