"""Every bound on what client connections may hold of the front door, so that thousands of
idle, slow or non-reading connections from one local client cannot stop it serving the others.

A connection is cheap while it sends nothing (an fd and ~6 KiB); what must not happen is that
the front door runs out of files or memory, or keeps a worker busy for a client that is gone.
The bounds, each enforced where it is cheapest:

- ``HEAD_TIMEOUT``: aiohttp's ``keepalive_timeout``. Its timer starts when a connection is
  made and again after each response, and closes the connection if by then no complete request
  head has arrived, so it is the deadline both for an idle keep-alive connection and for a
  slowly sent head (slowloris). A request already being handled is never closed by it.
- ``BODY_TIMEOUT``: the whole body must arrive within it once its handler starts reading (a
  408, then the connection is closed after at most ``LINGERING_TIME``).
- ``WRITE_TIMEOUT``: a client that takes no data of its answer for this long is cut off, and
  with it the connection to the worker, which then cancels the request and frees its blocks.
  Until then a non-reading client costs a bounded buffer: aiohttp waits for the socket to
  drain before each write beyond 64 KiB, and the front door reads nothing more from the worker
  meanwhile.
- ``MAX_CLIENT_CONNECTIONS``: open client connections. One more closes the oldest connection
  that has no request in progress, or, when every one has, is answered 503 before anything is
  read from it and closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource

from aiohttp import web

log = logging.getLogger("vqpool.serve")

HEAD_TIMEOUT = 15.0
"""Seconds a connection may stay open without a complete request head (counted from the
connection, or from the previous response on a kept-alive one): long enough for any client
between two requests, short enough that a flood of idle connections drains on its own."""
BODY_TIMEOUT = 30.0
"""Seconds a request's body may take to arrive: 8 MiB (the largest accepted) takes well under
a second on loopback, so only a trickle takes longer."""
WRITE_TIMEOUT = 30.0
"""Seconds a client may take no data of its answer before it is cut off; shorter than the
worker's own write timeout (60 s), so the front door decides and the worker is freed first."""
LINGERING_TIME = 2.0
"""Seconds the unread rest of a refused request's body is still read (and dropped) so the
client sees the refusal rather than a reset; aiohttp's default is 10."""
MAX_LINGERING = 256
"""Refused connections whose request is still read (and dropped) before they close, at most."""
MAX_CLIENT_CONNECTIONS = 8192
"""Open client connections at most, if the open-file limit allows (see :func:`connection_cap`):
a few thousand idle ones cost ~50 MiB."""
LISTEN_BACKLOG = 1024
"""Connections the kernel queues before they are accepted (they cost the front door nothing
until then)."""
FILES_KEPT = 256
"""Open files never given to client connections: workers' connections, logs, the daemon's and
control sockets."""

_REFUSAL = json.dumps(
    {
        "error": {
            "message": "too many open connections, every one with a request in progress",
            "type": "overloaded",
            "param": None,
            "code": 503,
        }
    }
).encode()


def connection_cap(limit: int | None = None) -> int:
    """Open client connections allowed: ``limit`` (or :data:`MAX_CLIENT_CONNECTIONS`), less
    when the soft open-file limit (already raised at start) leaves fewer files for them."""
    wanted = MAX_CLIENT_CONNECTIONS if limit is None else limit
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return wanted
    room = max(1, soft - FILES_KEPT - MAX_LINGERING)
    if room < wanted:
        log.warning(
            "open-file limit %d: at most %d client connections (%d wanted)", soft, room, wanted
        )
    return min(wanted, room)


class Refusal(asyncio.Protocol):
    """A connection beyond the cap: a 503 before anything is read, then closed once the client
    has sent all it sends (what it sends is dropped) or after ``LINGERING_TIME``. Closing with
    its request unread would reset the connection, and the client would see no 503."""

    lingering = 0
    """Refusals waiting for their client to finish sending; beyond ``MAX_LINGERING`` the next
    ones are closed at once."""

    def __init__(self) -> None:
        self.closing: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(_REFUSAL)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
        )
        transport.write(head.encode() + _REFUSAL)
        if Refusal.lingering >= MAX_LINGERING:
            transport.close()
            return
        Refusal.lingering += 1
        transport.write_eof()
        self.closing = asyncio.get_running_loop().call_later(LINGERING_TIME, transport.close)

    def eof_received(self) -> bool:
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        if self.closing is not None:
            self.closing.cancel()
            Refusal.lingering -= 1


class ConnectionCap:
    """The listening socket's protocol factory: aiohttp's, at most ``limit`` connections open.

    Whether a connection has a request in progress, or is closing, is read from aiohttp's
    ``RequestHandler`` (``_request_in_progress``, ``_force_close``, as of 3.14): it offers no
    public way to tell.
    """

    def __init__(self, server: web.Server, limit: int) -> None:
        self.server = server
        self.limit = limit
        # Handlers made but not connected yet: one event-loop turn accepts a whole backlog
        # before any of them reaches the server's list, and they count too.
        self.pending: list[web.RequestHandler] = []

    def __call__(self) -> asyncio.BaseProtocol:
        self.pending = [h for h in self.pending if h.transport is None and not h._force_close]
        if len(self.server.connections) + len(self.pending) >= self.limit:
            open_now = [c for c in self.server.connections if not c._force_close]  # oldest first
            if len(open_now) + len(self.pending) >= self.limit:
                idle = next((c for c in open_now if not c._request_in_progress), None)
                if idle is None:
                    return Refusal()
                idle.force_close()
        handler = self.server()
        self.pending.append(handler)
        return handler


class CappedTCPSite(web.TCPSite):
    """aiohttp's TCP site with :class:`ConnectionCap` as its protocol factory (its own start
    passes the runner's server as the factory, and offers no hook for another)."""

    def __init__(
        self, runner: web.BaseRunner, host: str, port: int, *, max_connections: int
    ) -> None:
        super().__init__(runner, host, port, backlog=LISTEN_BACKLOG)
        self.max_connections = max_connections
        self.cap: ConnectionCap | None = None

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        assert self._runner.server is not None
        self.cap = ConnectionCap(self._runner.server, self.max_connections)
        self._server = await asyncio.get_running_loop().create_server(
            self.cap, self._host, self._port, backlog=self._backlog
        )
        self._bound_port = self._server.sockets[0].getsockname()[1]
