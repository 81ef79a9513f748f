"""The worker's side of cooperative reclaim: wait at the daemon for asks to give bytes back, hand
each to the worker's handler, and answer with the bytes freed.

The daemon never sends a worker anything unasked (its replies go to request envelopes, and a
:class:`~vqpool.worker.pool.client.PoolClient`'s sockets are reopened on silence, so an unsolicited
message could land on a closed socket or be read as a stale reply). So the worker keeps one
``reclaim_poll`` parked at the daemon on a socket of its own (``waiting_call``), and the ask
comes back as its reply the moment the daemon decides. The handler runs on this thread; it
may block until the worker's scheduler has freed blocks at its next step boundary (through the
usual ``free``/``free_all``). When it returns, the bytes this client's holdings fell by since
the ask are reported with ``reclaim_done``; the daemon checks them against its ledger.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from vqpool.shared.errors import DaemonUnavailableError, ErrorCode, NoSessionError, VqpoolError
from vqpool.shared.protocol import RECLAIM_DONE, RECLAIM_POLL, encode_request
from vqpool.worker.pool.waiting_call import Superseded, request_waiting

if TYPE_CHECKING:
    from vqpool.worker.pool.client import PoolClient

log = logging.getLogger("vqpool.worker")

ReclaimHandler = Callable[[int, float], None]
"""``handler(n_bytes, deadline)``: give back about ``n_bytes`` of KV memory before the
monotonic time ``deadline`` (preempt requests at the next step boundary and free their
blocks); may block until done. Its return is the signal to answer the daemon."""

POLL_SECONDS = 5.0
"""How long one poll waits at the daemon before it is renewed (well inside the protocol's
30 s bound; a renewal is one small request)."""

_UNSUPPORTED = frozenset({ErrorCode.UNKNOWN_OP, ErrorCode.BAD_REQUEST})
"""Answers of a daemon older than reclaim (a reclaim_poll of this client is never malformed)."""

RETRY_SECONDS = 0.5
"""Pause after a poll the daemon could not answer (restarting, session being replaced)."""


class ReclaimListener(threading.Thread):
    """Polls for reclaim asks for ``client`` and answers them with ``handler``'s frees."""

    def __init__(self, client: PoolClient, handler: ReclaimHandler) -> None:
        super().__init__(name=f"vqpool-reclaim-{client.session_id}", daemon=True)
        self._client = client
        self.handler = handler
        self.answered = 0

    def run(self) -> None:
        client = self._client
        closing = client._closing
        while not closing.is_set():
            session = client._session
            rid = next(client._ids)
            payload = encode_request(rid, RECLAIM_POLL, {"wait": POLL_SECONDS}, *session)
            try:
                reply = request_waiting(
                    client._context,
                    client._endpoint,
                    payload,
                    rid,
                    wait=POLL_SECONDS,
                    timeout=client.timeout,
                    closing=closing,
                    current=lambda session=session: client._session == session,  # type: ignore[misc]
                    what=RECLAIM_POLL,
                )
            except NoSessionError:
                return  # closing
            except Superseded:
                continue  # poll again in the new session
            except DaemonUnavailableError:
                closing.wait(RETRY_SECONDS)
                continue
            if not reply.get("ok") and reply["error"]["code"] in _UNSUPPORTED:
                log.warning(
                    "reclaim: vqpoold does not take reclaim polls (%s); this worker will not be "
                    "asked to give memory back",
                    reply["error"]["message"],
                )
                return
            # Another lifetime or an ended session: the heartbeat re-syncs or reopens.
            if not reply.get("ok") or reply.get("boot") != session[1]:
                closing.wait(RETRY_SECONDS)
                continue
            ask = reply.get("result") or {}
            if ask.get("ask") is not None:
                self._answer(ask["ask"], ask["bytes"], ask["deadline"])

    def _answer(self, ask_id: int, n_bytes: int, seconds_left: float) -> None:
        client = self._client
        before = client.held_bytes()
        try:
            self.handler(n_bytes, time.monotonic() + seconds_left)
        except Exception:
            log.exception("reclaim handler failed for an ask of %d bytes", n_bytes)
        freed = max(0, before - client.held_bytes())
        try:
            with client._lock:
                client._call(RECLAIM_DONE, {"ask": ask_id, "freed": freed})
        except (VqpoolError, ValueError) as exc:
            # The ask is over for the daemon anyway (late, or its session ended).
            log.warning("reclaim: could not answer ask %d: %s", ask_id, exc)
        self.answered += 1
