"""Calls that give back (``free``, ``free_all``, ``release_owner``, ``mark_used``) kept for
later while vqpoold does not answer.

A request that ends while the daemon is down (killed, stopped, restarting) must not wait for it:
its blocks are the worker's, the worker drops their memory at once, and the daemon learns of it
later. So when the heartbeat has found the daemon silent, or such a call went unanswered, the
client forgets the blocks as if the call had been answered and keeps the call here. Before any
later request (or from the heartbeat, once the daemon answers again) the calls kept are sent,
oldest first, in the session they were made in; nothing else of the client is sent before them,
so none of those blocks can come back to this client and then be freed by a late call. A call
of a session the client no longer has is dropped: a restarted daemon got no claim for those
blocks (the client forgot them, so its re-sync did not declare them), and an ended session's
blocks were freed with it.

A call kept after it went unanswered may have been applied: sent again, the daemon finds its
blocks already free (skipped) or its owner gone (an error, logged). Kept calls are encoded once,
so a settle that times out resends the same request id.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vqpool.shared.errors import ErrorCode
from vqpool.shared.protocol import encode_request
from vqpool.worker.pool.session import DaemonSession, Session

log = logging.getLogger("vqpool.worker")

DEFERRED_OPS = frozenset({"free", "free_all", "release_owner", "mark_used"})
"""The calls that may be kept for later: each gives back or updates what the client holds,
and none has a result the caller needs."""


@dataclass
class DeferredCall:
    """A call kept for ``session``; ``sent`` is its (request id, bytes) once encoded."""

    session: Session
    op: str
    args: dict[str, Any]
    sent: tuple[int, bytes] | None = None


class DeferredCalls:
    """The calls kept while the daemon did not answer, oldest first. Guarded by the client's
    lock."""

    def __init__(self, session: DaemonSession) -> None:
        self._session = session
        self._due: list[DeferredCall] = []

    def __bool__(self) -> bool:
        return bool(self._due)

    def __len__(self) -> int:
        return len(self._due)

    def add(self, op: str, args: dict[str, Any]) -> None:
        """Keep ``op`` with ``args`` for the current session."""
        if op not in DEFERRED_OPS:
            raise ValueError(f"{op} cannot be deferred")
        self._due.append(DeferredCall(self._session.current, op, args))

    def settle(self) -> None:
        """Send the calls kept, in their session; drop those of another. The caller holds
        the lock.

        Raises:
            DaemonUnavailableError: The daemon did not answer (the rest stays due).
        """
        current = self._session.current
        # Calls of another session: a restart or an eviction freed what they gave back.
        self._due = [call for call in self._due if call.session == current]
        while self._due:
            call = self._due[0]
            rid, payload = call.sent or self._encode(call)
            reply = self._session.send(payload, rid, call.op)
            del self._due[0]
            ended = not reply["ok"] and reply["error"]["code"] == ErrorCode.NO_SESSION
            if ended or reply.get("boot") != current[1]:
                # Restarted or ended meanwhile: the rest went with the session (the next call
                # re-syncs or reopens).
                self._due.clear()
            elif not reply["ok"]:
                log.info("%s kept while vqpoold was silent: %s", call.op, reply["error"]["message"])

    def _encode(self, call: DeferredCall) -> tuple[int, bytes]:
        """``call`` as a request of its session, encoded once: a send that times out is
        repeated with the same request id."""
        rid = self._session.next_id()
        call.sent = (rid, encode_request(rid, call.op, call.args, *call.session))
        return call.sent
