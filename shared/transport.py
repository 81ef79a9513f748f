"""Request/reply over a ZeroMQ DEALER with Lazy Pirate retries (ZeroMQ guide, chapter 4).

A reply can be lost (the daemon dropped it because our queue was full, the connection broke, the
daemon was restarted). Waiting forever on one socket would hang the caller, so each attempt
waits a bounded time; on silence the socket is closed with linger 0 (its queue goes with it),
a fresh one is opened, and the *same bytes* are sent again. The request id inside those bytes
lets the daemon answer a repeat from its reply cache instead of applying it twice.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import zmq
from vqpool.shared.errors import DaemonUnavailableError
from vqpool.shared.protocol import MAX_REPLY_BYTES, decode_reply

# First wait before a resend, doubled per silent attempt up to the cap. Generous next to a
# ~100 us round trip: a resend is cheap for the daemon (reply cache) but a reconnect storm from
# every client of a briefly busy daemon is not.
FIRST_RETRY_SECONDS = 0.5
MAX_RETRY_SECONDS = 2.0


class LazyPirateConnection:
    """One request at a time to ``endpoint``; not thread-safe (callers serialize)."""

    def __init__(
        self,
        context: zmq.Context[Any],
        endpoint: str,
        *,
        first_retry: float = FIRST_RETRY_SECONDS,
        max_retry: float = MAX_RETRY_SECONDS,
    ) -> None:
        self._context = context
        self.endpoint = endpoint
        self._first_retry = first_retry
        self._max_retry = max_retry
        self._socket: zmq.Socket[bytes] | None = None
        self._rcvtimeo = -2
        self.n_resends = 0

    def _open(self) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
        sock.connect(self.endpoint)
        self._socket = sock
        self._rcvtimeo = -2
        return sock

    def reset(self) -> None:
        """Drop the socket and whatever it had queued; the next request opens a fresh one."""
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    close = reset

    def request(self, payload: bytes, rid: int, timeout: float, what: str) -> dict[str, Any]:
        """Send ``payload`` (request id ``rid``) and return the decoded reply to it.

        Resends the same bytes on a fresh socket after each silent wait until ``timeout``
        seconds have passed.

        Raises:
            DaemonUnavailableError: No reply within ``timeout``; ``what`` names the call.
        """
        deadline = time.monotonic() + timeout
        wait = self._first_retry
        while True:
            sock = self._socket or self._open()
            # Again: the queue to a long-absent daemon is full: wait, then reopen and resend.
            with contextlib.suppress(zmq.Again):
                sock.send(payload, zmq.NOBLOCK)
            attempt_end = min(time.monotonic() + wait, deadline)
            reply = self._await(sock, rid, attempt_end)
            if reply is not None:
                return reply
            self.reset()
            if time.monotonic() >= deadline:
                raise DaemonUnavailableError(
                    f"no reply to {what} from {self.endpoint} in {timeout:g}s"
                )
            self.n_resends += 1
            wait = min(wait * 2, self._max_retry)

    def _await(self, sock: zmq.Socket[bytes], rid: int, until: float) -> dict[str, Any] | None:
        """The reply to ``rid`` if it arrives before ``until``; earlier replies are skipped."""
        while True:
            remaining_ms = int((until - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                return None
            if remaining_ms != self._rcvtimeo:
                sock.setsockopt(zmq.RCVTIMEO, remaining_ms)
                self._rcvtimeo = remaining_ms
            try:
                frame = sock.recv()
            except zmq.Again:
                return None
            reply = decode_reply(frame)
            # A nil id answers a request the daemon could not parse: on this socket only ours
            # is in flight.
            reply_id = reply.get("id")
            if reply_id == rid or reply_id is None:
                return reply
