"""Who may connect: a ZAP handler that admits only peers of the daemon's own user id.

Three layers keep other users and other protocols away from the request handlers:

1. The sockets live in the 0700 run directory (checked at start): another user cannot even
   reach the socket files.
2. Every connection to the worker and admin sockets is authenticated by this ZAP handler
   (ZeroMQ's authentication protocol, RFC 27) before a single message is delivered. libzmq
   fills the ZAP request's address with the peer's credentials from the kernel (Linux:
   ``SO_PEERCRED``, giving ``uid:gid:pid``; other platforms where libzmq reads them with
   ``LOCAL_PEERCRED``/``getpeereid``): a peer whose uid is not the daemon's is refused. Where
   the platform gives no credentials (the address names no uid), the directory is the guard.
3. A connection that does not complete a ZMTP 3 handshake never produces a message: with a
   ZAP domain set libzmq refuses the ZMTP 1.0/2.0 fallbacks that would otherwise turn random
   bytes into messages, and a mechanism other than NULL (PLAIN, CURVE) is refused here.

Why ZAP rather than a hello-first rule in the request handler: ZAP runs inside libzmq's
handshake, once per connection, so garbage never reaches the decoder at all and costs the
request hot path nothing; and it is the one place where the kernel's peer credentials are
available per connection (checking the per-message ``Peer-Address`` property instead would
cost a property lookup on every request; only hello reads it, see ``daemon/net/peer_process.py``).

The handler is a REP socket on ``inproc://zeromq.zap.01`` in the daemon's context, served by
the daemon's own poll loop: no thread. It must be bound before the sockets it guards, since
libzmq admits connections unauthenticated when no handler is bound.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, cast

import zmq
from vqpool.daemon.net.peer_log import BAD_REQUEST_LOG_INTERVAL

log = logging.getLogger("vqpoold")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
WORKER_DOMAIN = b"vqpool-worker"
ADMIN_DOMAIN = b"vqpool-admin"
_DOMAINS = frozenset({WORKER_DOMAIN, ADMIN_DOMAIN})
_ZAP_VERSION = b"1.0"


def peer_uid(address: bytes) -> int | None:
    """The uid in a ZAP address of an ipc peer (``localhost:uid:gid:pid`` on Linux), or None
    when the platform gave no credentials."""
    parts = address.decode(errors="replace").split(":")
    if len(parts) >= 3 and parts[1].isdigit():
        return int(parts[1])
    return None


def peer_pid(address: bytes) -> int | None:
    """The pid in a ZAP address or ``Peer-Address`` property of an ipc peer
    (``localhost:uid:gid:pid`` on Linux), or None when the platform gave none (macOS)."""
    parts = address.decode(errors="replace").split(":")
    if len(parts) >= 4 and parts[1].isdigit() and parts[3].isdigit():
        return int(parts[3])
    return None


class PeerAuthenticator:
    """Answers libzmq's ZAP requests for the daemon's sockets.

    Attributes:
        n_accepted: Connections admitted.
        n_refused: Connections refused (another uid, an unknown domain, a mechanism other
            than NULL).
    """

    def __init__(self, context: zmq.Context[Any], uid: int | None = None) -> None:
        self.uid = os.getuid() if uid is None else uid
        self.socket: zmq.Socket[bytes] = context.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(ZAP_ENDPOINT)
        self.n_accepted = 0
        self.n_refused = 0
        # (domain, address) -> monotonic time of its last log line; cleared when large, so a
        # flood of connections cannot grow it.
        self._logged: dict[tuple[bytes, bytes], float] = {}

    def serve(self, limit: int = sys.maxsize) -> bool:
        """Answer up to ``limit`` waiting ZAP requests (called by the poll loop when the socket
        is ready); whether more are waiting. A limit lets the loop look at other work between
        batches during a connection flood."""
        sock = self.socket
        for _ in range(limit):
            if not cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return False
            request = sock.recv_multipart()
            sock.send_multipart(self._answer(request))
        return bool(cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        if len(request) < 6 or request[0] != _ZAP_VERSION:
            # Not from libzmq (nothing else can reach an inproc endpoint of our context).
            return [_ZAP_VERSION, request[1] if len(request) > 1 else b"", b"500", b"bad", b"", b""]
        request_id, domain, address, _identity, mechanism = request[1:6]
        reason = self._refusal(domain, address, mechanism)
        if reason is None:
            self.n_accepted += 1
            return [_ZAP_VERSION, request_id, b"200", b"OK", str(self.uid).encode(), b""]
        self.n_refused += 1
        self._note_refusal(domain, address, reason)
        return [_ZAP_VERSION, request_id, b"400", reason.encode(), b"", b""]

    def _refusal(self, domain: bytes, address: bytes, mechanism: bytes) -> str | None:
        """Why a connection is refused, or None to admit it."""
        if domain not in _DOMAINS:
            return f"unknown ZAP domain {domain!r}"
        if mechanism != b"NULL":
            return f"security mechanism {mechanism.decode(errors='replace')!r} is not spoken here"
        uid = peer_uid(address)
        if uid is not None and uid != self.uid:
            return f"peer runs as uid {uid}, this daemon as uid {self.uid}"
        return None

    def _note_refusal(self, domain: bytes, address: bytes, reason: str) -> None:
        """Log a refused connection, at most once per peer and socket per interval."""
        now = time.monotonic()
        key = (domain, address)
        if now - self._logged.get(key, -BAD_REQUEST_LOG_INTERVAL) < BAD_REQUEST_LOG_INTERVAL:
            return
        if len(self._logged) >= 1024:
            self._logged.clear()
        self._logged[key] = now
        socket_name = domain.decode(errors="replace").removeprefix("vqpool-")
        log.warning(
            "refused a connection to the %s socket from %s: %s (%d refused so far)",
            socket_name,
            address.decode(errors="replace") or "a peer with no credentials",
            reason,
            self.n_refused,
        )

    def close(self) -> None:
        self.socket.close(linger=0)
