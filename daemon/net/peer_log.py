"""Rate-limited logging of misbehaving peers: a bad request is logged at most once per peer per
interval, with a count of what was held back."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("vqpoold")

BAD_REQUEST_LOG_INTERVAL = 10.0
"""Seconds between two log lines about bad requests from one peer."""

_MAX_TRACKED_PEERS = 1024


class PeerLogLimiter:
    """Logs a bad request at most once per peer per interval, counting what it held back.

    A misbehaving peer can send thousands of bad requests a second; logging each would turn the
    daemon into a log pump. The table is bounded: past ``_MAX_TRACKED_PEERS`` peers it starts
    over, so random connections cannot grow it.
    """

    def __init__(self, interval: float = BAD_REQUEST_LOG_INTERVAL) -> None:
        self._interval = interval
        self._peers: dict[bytes, tuple[float, int]] = {}

    def note(self, peer: bytes, socket_name: str, message: str) -> None:
        """Record one bad request from ``peer``; log it unless this peer was logged recently."""
        now = time.monotonic()
        last, held_back = self._peers.get(peer, (0.0, 0))
        if last and now - last < self._interval:
            self._peers[peer] = (last, held_back + 1)
            return
        if len(self._peers) >= _MAX_TRACKED_PEERS:
            self._peers.clear()
        self._peers[peer] = (now, 0)
        more = f" ({held_back} more from this peer since the last line)" if held_back else ""
        log.warning(
            "bad request on the %s socket from peer %s: %s%s",
            socket_name,
            peer.hex(),
            message,
            more,
        )
