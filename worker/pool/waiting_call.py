"""One request the daemon may park: Lazy Pirate on a socket of its own, that a closing client
can cut short.

An ``allocate`` with ``wait`` > 0 gets no reply until the daemon's budget grants it or its wait
runs out, so it cannot go over the client's main connection (every other call of the worker
would queue behind it). Each waiting call opens its own DEALER, so several threads may wait at
once and none holds the client's lock while parked. As in
:class:`~vqpool.shared.transport.LazyPirateConnection`, silence past an attempt's timeout means
a lost reply: the *same bytes* (same request id) are sent again on a fresh socket, and the
daemon answers the resend from its reply cache, or moves the parked request to the new
envelope, never queueing it twice. The socket is polled in short slices so that
:meth:`PoolClient.close` ends a parked call within ``SLICE_SECONDS`` instead of the wait, and so
that a call given up on meanwhile is cancelled at the daemon (``on_slice``, which sends the
``cancel`` op: the daemon then answers the parked request CANCELLED at once).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from vqpool.shared.errors import DaemonUnavailableError, NoSessionError
from vqpool.shared.protocol import MAX_REPLY_BYTES, decode_reply

SLICE_SECONDS = 0.1
"""How often a parked call looks whether its client is closing or its session was replaced."""

REPLY_MARGIN_SECONDS = 1.0
"""Added to the wait for one attempt's timeout: the daemon answers at the wait's end at the
latest, so silence beyond this margin means the reply was lost."""


class Superseded(Exception):
    """The session the request was sent in was replaced meanwhile (another thread re-synced
    with a restarted daemon, or reopened an evicted session): no reply will count."""


def request_waiting(
    context: zmq.Context[Any],
    endpoint: str,
    payload: bytes,
    rid: int,
    *,
    wait: float,
    timeout: float,
    closing: threading.Event,
    current: Callable[[], bool],
    what: str,
    on_slice: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Send ``payload`` (request id ``rid``) and return the reply to it.

    Each attempt waits ``wait + REPLY_MARGIN_SECONDS``; the whole call ``wait + timeout``.
    ``on_slice`` is called every ``SLICE_SECONDS`` or so while no reply came.

    Raises:
        DaemonUnavailableError: No reply in time.
        NoSessionError: ``closing`` was set (the client is closing).
        Superseded: ``current()`` turned false (the request's session was replaced).
    """
    deadline = time.monotonic() + wait + timeout
    attempt = wait + REPLY_MARGIN_SECONDS
    while True:
        try:
            reply = _attempt(
                context, endpoint, payload, rid, attempt, deadline, closing, current, on_slice
            )
        except zmq.ContextTerminated:  # closed between two looks at ``closing``
            raise NoSessionError("the PoolClient was closed while its call waited") from None
        if reply is not None:
            return reply
        if time.monotonic() >= deadline:
            raise DaemonUnavailableError(
                f"no reply to {what} from {endpoint} in {wait + timeout:g}s"
            )


def _attempt(
    context: zmq.Context[Any],
    endpoint: str,
    payload: bytes,
    rid: int,
    attempt: float,
    deadline: float,
    closing: threading.Event,
    current: Callable[[], bool],
    on_slice: Callable[[], None] | None,
) -> dict[str, Any] | None:
    """One send on a fresh socket and the wait for its reply (None: silence)."""
    sock: zmq.Socket[bytes] = context.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
        sock.connect(endpoint)
        # Again: the queue to an absent daemon is full: wait, then resend on a new socket.
        with contextlib.suppress(zmq.Again):
            sock.send(payload, zmq.NOBLOCK)
        until = min(time.monotonic() + attempt, deadline)
        return _await(sock, rid, until, closing, current, on_slice)
    finally:
        sock.close(linger=0)


def _await(
    sock: zmq.Socket[bytes],
    rid: int,
    until: float,
    closing: threading.Event,
    current: Callable[[], bool],
    on_slice: Callable[[], None] | None,
) -> dict[str, Any] | None:
    """The reply to ``rid`` if it arrives before ``until``; earlier replies are skipped."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while True:
        if closing.is_set():
            raise NoSessionError("the PoolClient was closed while its call waited")
        if not current():
            raise Superseded()
        remaining = until - time.monotonic()
        if remaining <= 0:
            return None
        if not poller.poll(int(min(remaining, SLICE_SECONDS) * 1000) + 1):
            if on_slice is not None:
                on_slice()
            continue
        reply = decode_reply(sock.recv())
        reply_id = reply.get("id")
        if reply_id == rid or reply_id is None:
            return reply
