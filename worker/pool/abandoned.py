"""Allocations a worker gave up waiting for, which the daemon may still grant.

A waiting ``allocate`` / ``allocate_many`` ends with DaemonUnavailableError when no reply came
in its wait plus the client's timeout (a daemon busy or unreachable meanwhile). The request may
still be applied after that: it sits in the daemon's input queue or in its budget's queue, and
its reply then goes to a socket that is closed. Its blocks would stay held, for an owner the
worker no longer counts on, until the session ends.

So the client keeps an :class:`AbandonedAllocation` for each, and before its next request (or
from the heartbeat, for an idle worker) sends the *same request id* again: the daemon answers
it from its reply cache if it was applied, hands the reply of a still-parked request to this
send, and applies it only if it never arrived. Whatever that reply grants is freed by id, in a
free request encoded once (a lost reply is resent as the same request, freeing nothing twice).
Until it is settled nothing else of the client is sent, so no other call can free those ids and
see them handed to another owner first. A request of a session the client no longer has (a
daemon restart, an eviction) needs nothing: its blocks went with that session.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vqpool.shared.allocator import Owner


@dataclass
class AbandonedAllocation:
    """A waiting allocation given up on, sent again as ``rid`` in ``session`` to learn its
    outcome; ``free`` is the request (id, bytes) giving back its blocks once they are known."""

    session: tuple[int | None, str | None]
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
