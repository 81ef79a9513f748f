"""Allocations a worker gave up waiting for, which the daemon may still grant.

A waiting ``allocate`` / ``allocate_many`` ends with DaemonUnavailableError when no reply came
in its wait plus the client's timeout (a daemon busy or unreachable meanwhile). The request may
still be applied after that: it sits in the daemon's input queue or in its budget's queue, and
its reply then goes to a socket that is closed. Its blocks would stay held, for an owner the
worker no longer counts on, until the session ends.

So the client keeps an :class:`AbandonedAllocation` for each (in :class:`AbandonedAllocations`),
and before its next request (or
from the heartbeat, for an idle worker) first cancels it at the daemon (the ``cancel`` op: one
still parked is answered CANCELLED, so it neither holds its model's queue up nor this client's
lock for the rest of its wait), then sends the *same request id* again: the daemon answers it
from its reply cache if it was applied (or cancelled), and applies it only if it never
arrived. Whatever that reply grants is freed by id, in a
free request encoded once (a lost reply is resent as the same request, freeing nothing twice).
Until it is settled nothing else of the client is sent, so no other call can free those ids and
see them handed to another owner first. A request of a session the client no longer has (a
daemon restart, an eviction) needs nothing: its blocks went with that session.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vqpool.shared.allocator import Owner
from vqpool.shared.protocol import CANCEL, encode_request
from vqpool.worker.pool.holdings import Holdings
from vqpool.worker.pool.session import DaemonSession, Session
from vqpool.worker.pool.waiting_call import Superseded


@dataclass
class AbandonedAllocation:
    """A waiting allocation given up on, sent again as ``rid`` in ``session`` to learn its
    outcome; ``free`` is the request (id, bytes) giving back its blocks once they are known."""

    session: Session
    rid: int
    op: str
    args: dict[str, Any]
    wait: float
    free: tuple[int, bytes] | None = None

    def owners(self) -> list[Owner]:
        """The owners the allocation was for."""
        if self.op == "allocate":
            return [self.args["owner"]]
        return [item[2] for item in self.args["items"]]


def granted_ids(op: str, result: Any) -> list[int]:
    """The block ids an ``allocate`` / ``allocate_many`` result gives (item errors give none)."""
    if op == "allocate":
        return list(result)
    return [block_id for item in result if isinstance(item, list) for block_id in item]


class AbandonedAllocations:
    """The waiting allocations a client gave up on, oldest first, until settled. Guarded by
    the client's lock."""

    def __init__(self, session: DaemonSession, holdings: Holdings) -> None:
        self._session = session
        self._holdings = holdings
        self._due: list[AbandonedAllocation] = []

    def __bool__(self) -> bool:
        return bool(self._due)

    def add(self, abandoned: AbandonedAllocation) -> None:
        self._due.append(abandoned)

    def settle(self) -> None:
        """Free what the allocations given up on were granted, if anything (module
        docstring). The caller holds the lock.

        Raises:
            DaemonUnavailableError: The daemon did not answer (the rest stays due).
        """
        session = self._session
        while self._due:
            abandoned = self._due[0]
            if abandoned.session != session.current:
                del self._due[0]  # a restart or an eviction freed what it held
                continue
            if abandoned.free is None:
                # Cancelled if still parked (refused if never received or answered: fine).
                rid = session.next_id()
                cancel = encode_request(rid, CANCEL, {"request": abandoned.rid}, *session.current)
                session.send(cancel, rid, CANCEL)
                # The same id without ``wait``: the daemon's answer to the request it got.
                payload = encode_request(
                    abandoned.rid, abandoned.op, abandoned.args, *session.current
                )
                try:
                    reply = session.wait_for(
                        payload,
                        abandoned.rid,
                        wait=abandoned.wait,
                        sent_in=abandoned.session,
                        what=f"{abandoned.op} (given up on before)",
                    )
                except Superseded:
                    continue
                ids = []
                if reply.get("boot") == abandoned.session[1] and reply["ok"]:
                    ids = granted_ids(abandoned.op, reply.get("result"))
                if not ids:  # refused, never applied, or by a daemon that since restarted
                    del self._due[0]
                    continue
                rid = session.next_id()
                free = encode_request(rid, "free", {"block_ids": ids}, *session.current)
                abandoned.free = (rid, free)
            rid, free = abandoned.free
            session.send(free, rid, "free")
            del self._due[0]
            for owner in abandoned.owners():
                self._holdings.forget_if_empty(owner)  # its only blocks: the daemon released it
