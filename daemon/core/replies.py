"""The reply cache: encoded replies to recent mutating requests, so a resent one is answered with
its first reply instead of being applied twice.

It is bounded three ways, so no client can grow the daemon through it: per session by count
(:data:`REPLIES_PER_SESSION`) and by bytes (:data:`REPLY_BYTES_PER_SESSION`), and over all
sessions by bytes (:data:`REPLY_BYTES_TOTAL`), oldest replies evicted first. A session's latest
reply is never evicted: a client with one call in flight can only resend that one, so a
well-behaved client never loses a reply to another session's traffic. The total is therefore
REPLY_BYTES_TOTAL plus at most one reply per session (a reply is bounded by the request limits of
``shared/protocol/limits.py``).

Once a reply is evicted, every request id up to it is refused (BAD_REQUEST) rather than applied:
the daemon can no longer tell whether it was.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from vqpool.shared.errors import BadRequestError

REPLIES_PER_SESSION = 64
"""Replies kept per session. A client has one call in flight at a time (plus heartbeats, which
are not cached), so only its latest request can ever be resent; 64 leaves room for clients that
pipeline."""

REPLY_BYTES_PER_SESSION = 1 << 20
"""Bytes of replies kept per session (beyond its latest reply): room for 3 of the largest
replies (65,536 block ids) or thousands of a decode step's."""

REPLY_BYTES_TOTAL = 32 << 20
"""Bytes of replies kept over all sessions (beyond each session's latest reply)."""


@dataclass(slots=True)
class _SessionReplies:
    replies: dict[int, bytes] = field(default_factory=dict)  # by request id, oldest first
    n_bytes: int = 0
    latest: int = -1  # request id of the reply remembered last (never evicted)
    floor: int = -1  # highest request id evicted; ids up to it are refused


class ReplyCache:
    """Recent replies of every session, by (session id, request id).

    Attributes:
        n_bytes: Bytes of replies held now, all sessions together.
        n_evicted: Replies evicted so far to stay within the bounds.
    """

    def __init__(
        self,
        per_session: int = REPLIES_PER_SESSION,
        bytes_per_session: int = REPLY_BYTES_PER_SESSION,
        bytes_total: int = REPLY_BYTES_TOTAL,
    ) -> None:
        self.per_session = per_session
        self.bytes_per_session = bytes_per_session
        self.bytes_total = bytes_total
        self.n_bytes = 0
        self.n_evicted = 0
        self._sessions: dict[int, _SessionReplies] = {}
        self._order: OrderedDict[tuple[int, int], None] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._order)

    def lookup(self, sid: int, rid: int) -> bytes | None:
        """The reply already sent to request ``rid`` of session ``sid``, or None if it is new.

        Raises:
            BadRequestError: ``rid`` is older than anything the cache still holds for this
                session: applying it now could apply it twice, so it is refused.
        """
        entry = self._sessions.get(sid)
        if entry is None:
            return None
        cached = entry.replies.get(rid)
        if cached is None and rid <= entry.floor:
            raise BadRequestError(
                f"request id {rid} is older than this session's reply cache (ids <= "
                f"{entry.floor} are forgotten); not applied"
            )
        return cached

    def remember(self, sid: int, rid: int, reply: bytes, *, late: bool = False) -> None:
        """Keep ``reply`` for a resend of ``rid``, evicting the oldest beyond the bounds.

        ``late``: the reply of a request that waited at the daemon (a parked allocation) while
        the session's later requests were answered: it is kept even if ids above it were
        evicted meanwhile (it is the newest reply now, and the one a resend must find)."""
        entry = self._sessions.get(sid)
        if entry is None:
            entry = self._sessions[sid] = _SessionReplies()
        elif (rid <= entry.floor and not late) or rid in entry.replies:
            return  # a refused stale id, or a reply already kept
        replies = entry.replies
        size = len(reply)
        replies[rid] = reply
        entry.n_bytes += size
        entry.latest = rid
        self.n_bytes += size
        self._order[(sid, rid)] = None
        per_session, bytes_per_session = self.per_session, self.bytes_per_session
        while len(replies) > 1 and (
            len(replies) > per_session or entry.n_bytes - size > bytes_per_session
        ):
            self._evict(sid, entry, next(iter(replies)))
        if self.n_bytes > self.bytes_total:
            self._evict_over_total()

    def forget(self, sid: int) -> None:
        """Drop every reply of session ``sid`` (it ended)."""
        entry = self._sessions.pop(sid, None)
        if entry is None:
            return
        for rid in entry.replies:
            del self._order[(sid, rid)]
        self.n_bytes -= entry.n_bytes

    def _evict(self, sid: int, entry: _SessionReplies, rid: int) -> None:
        size = len(entry.replies.pop(rid))
        del self._order[(sid, rid)]
        entry.n_bytes -= size
        self.n_bytes -= size
        self.n_evicted += 1
        if rid > entry.floor:
            entry.floor = rid

    def _evict_over_total(self) -> None:
        """Evict the oldest replies of any session until the total fits, sparing each
        session's latest (moved to the back: every other reply of its session is older)."""
        order = self._order
        n_spared = 0
        while self.n_bytes > self.bytes_total and n_spared < len(order):
            sid, rid = key = next(iter(order))
            entry = self._sessions[sid]
            if rid == entry.latest:
                order.move_to_end(key)
                n_spared += 1
            else:
                self._evict(sid, entry, rid)
