"""The worker's side of cooperative reclaim: wait at the daemon for asks to give bytes back, hand
each to the worker's handler, and answer with the bytes freed.

The daemon never sends a worker anything unasked (its replies go to request envelopes, and a
client's sockets are reopened on silence, so an unsolicited
message could land on a closed socket or be read as a stale reply). So the worker keeps one
``reclaim_poll`` parked at the daemon on a socket of its own (``waiting_call``), and the ask
comes back as its reply the moment the daemon decides. The handler runs on this thread; it
may block until the worker's scheduler has freed blocks at its next step boundary (through the
usual ``free``/``free_all``). When it returns, the bytes this client's holdings fell by since
the ask are reported with ``reclaim_done``; the daemon checks them against its ledger.

The listener knows its client only by its session (to poll in) and two callables: the bytes
held now, and one call to the daemon under the client's rules.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from vqpool.shared.errors import DaemonUnavailableError, ErrorCode, NoSessionError, VqpoolError
from vqpool.shared.protocol import RECLAIM_DONE, RECLAIM_POLL, encode_request
from vqpool.worker.pool.session import DaemonSession
from vqpool.worker.pool.waiting_call import Superseded

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
    """Polls for reclaim asks in ``session`` and answers them with ``handler``'s frees.

    Args:
        session: The client's session (polls are sent in its current session).
        handler: Gives the bytes back (replaceable: :attr:`handler`).
        held_bytes: The bytes the client holds now.
        call: One call to the daemon under the client's lock and rules (the answer).
    """

    def __init__(
        self,
        session: DaemonSession,
        handler: ReclaimHandler,
        *,
        held_bytes: Callable[[], int],
        call: Callable[[str, Mapping[str, Any]], Any],
    ) -> None:
        super().__init__(name=f"vqpool-reclaim-{session.session_id}", daemon=True)
        self._session = session
        self.handler = handler
        self._held_bytes = held_bytes
        self._call = call

    def run(self) -> None:
        session = self._session
        closing = session.closing
        while not closing.is_set():
            sent_in = session.current
            rid = session.next_id()
            payload = encode_request(rid, RECLAIM_POLL, {"wait": POLL_SECONDS}, *sent_in)
            try:
                reply = session.wait_for(
                    payload, rid, wait=POLL_SECONDS, sent_in=sent_in, what=RECLAIM_POLL
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
            if not reply.get("ok") or reply.get("boot") != sent_in[1]:
                closing.wait(RETRY_SECONDS)
                continue
            ask = reply.get("result") or {}
            if ask.get("ask") is not None:
                self._answer(ask["ask"], ask["bytes"], ask["deadline"])

    def _answer(self, ask_id: int, n_bytes: int, seconds_left: float) -> None:
        before = self._held_bytes()
        try:
            self.handler(n_bytes, time.monotonic() + seconds_left)
        except Exception:
            log.exception("reclaim handler failed for an ask of %d bytes", n_bytes)
        freed = max(0, before - self._held_bytes())
        try:
            self._call(RECLAIM_DONE, {"ask": ask_id, "freed": freed})
        except (VqpoolError, ValueError) as exc:
            # The ask is over for the daemon anyway (late, or its session ended).
            log.warning("reclaim: could not answer ask %d: %s", ask_id, exc)
