"""Parked requests: allocations waiting at the daemon for bytes, and where and when they are
answered.

An ``allocate`` or ``allocate_many`` with ``wait`` > 0 that the ledger queues gets no reply when
it arrives: it is *parked* under its ticket (session id, request id), and the server loop keeps
in it the envelope of its newest send. It is answered later, from here, in one of four ways:

- granted (:meth:`Parking.hand_out`, after anything that frees bytes): the allocation is done
  then and its result is the reply;
- its deadline passed (:meth:`Parking.expire`): POOL_EXHAUSTED;
- its session was asked to give bytes back meanwhile, for a growth
  (:meth:`Parking.refuse_growth_of`): POOL_EXHAUSTED;
- a live settings change made it impossible (:meth:`Parking.answer_refused`): OVER_BUDGET;
- its own session cancelled it (:meth:`Parking.cancel`, the ``cancel`` worker op: its client
  went away): CANCELLED.

Each late reply is remembered in the reply cache (a resend after it gets it from there) and put
in :attr:`Parking.outbox`, which the server loop sends non-blocking. A resend while it is still
parked is not applied again: the worker socket finds it in :attr:`Parking.parked` and returns
it, and the loop keeps the resend's envelope, so the late reply goes to the newest send. A parked
request of a session that ended is dropped unanswered.

What parked requests may keep is bounded (:meth:`Parking.check_room`), as the reply cache is:
per session by the bytes their items keep (:data:`WAITING_BYTES_PER_SESSION`), and per process
by count and bytes (:data:`WAITING_PER_PROCESS`, :data:`WAITING_BYTES_PER_PROCESS`), so that one
process cannot take the ledger's global cap on waiting requests (or the daemon's memory) from
everybody else, however many sessions or model names it opens. A request over a bound is
refused (POOL_EXHAUSTED, saying which bound) and changes nothing.

A worker's ``reclaim_poll`` waiting for an ask is parked the same way
(``budget/reclaim_service.py``) and sent from the same outbox. See docs/budget.md and
docs/protocol.md.
"""

from __future__ import annotations

from vqpool.daemon.budget.holdings import Holdings, Items
from vqpool.daemon.budget.types import Ticket, Verdict
from vqpool.daemon.budget.views import budget_text, held_text, refusal
from vqpool.daemon.core.error_reply import error_reply
from vqpool.daemon.core.replies import ReplyCache
from vqpool.daemon.core.sessions import Session
from vqpool.shared.byte_sizes import format_bytes
from vqpool.shared.errors import BadRequestError, BlockPoolExhaustedError, RequestCancelledError
from vqpool.shared.protocol import encode_result

WAITING_BYTES_PER_SESSION = 4 << 20
"""Bytes one session's parked requests may keep (estimated by :func:`kept_bytes`): room for a
few thousand items with the longest owners, or hundreds of a worker's usual waiting
allocations."""

WAITING_BYTES_PER_PROCESS = 16 << 20
"""Bytes the parked requests of all the sessions of one process may keep."""

WAITING_PER_PROCESS = 256
"""Requests the sessions of one process may have parked: a quarter of the ledger's cap on all
waiting requests (``DEFAULT_MAX_WAITING``), so no one process fills it for everybody."""

_REQUEST_COST = 512  # a parked request, its envelope and the ledger's waiter
_ITEM_COST = 256  # an item's tuple, its stream and format strings, its owner (without text)


def kept_bytes(items: Items) -> int:
    """What a parked request of ``items`` keeps in the daemon's memory, estimated from above
    (the item tuples and their strings; owners' text counted by length)."""
    n = _REQUEST_COST
    for _, _, owner, _ in items:
        n += _ITEM_COST + len(owner) if type(owner) is str else _ITEM_COST
    return n


class Parked:
    """A request answered later, not when it arrives: ``envelope`` holds the routing frames of
    its newest send (set by the server loop), where its late reply goes."""

    __slots__ = ("envelope",)

    def __init__(self) -> None:
        self.envelope: list[bytes] | None = None


class ParkedRequest(Parked):
    """An allocation waiting at the daemon for bytes: what to do once granted."""

    __slots__ = (
        "deadline",
        "growth",
        "items",
        "kept",
        "n_bytes",
        "op",
        "rid",
        "session",
        "wait",
    )

    def __init__(
        self,
        session: Session,
        op: str,
        items: Items,
        rid: int,
        n_bytes: int,
        wait: float,
        now: float,
        growth: bool = False,
    ) -> None:
        super().__init__()
        self.session = session
        self.op = op
        self.items = items
        self.rid = rid
        self.n_bytes = n_bytes
        self.wait = wait
        self.deadline = now + wait
        self.growth = growth
        self.kept = kept_bytes(items)


class Parking:
    """The parked allocations by ticket, and the outbox of late replies.

    Args:
        holdings: Performs a granted allocation (and credits what it did not use).
        replies: The reply cache late replies are remembered in.
        boot_id: The daemon lifetime stamped on the replies.
    """

    def __init__(self, holdings: Holdings, replies: ReplyCache, boot_id: str) -> None:
        self._holdings = holdings
        self._ledger = holdings.ledger
        self._replies = replies
        self._boot_id = boot_id
        self.parked: dict[Ticket, ParkedRequest] = {}
        """The parked allocations (the same dict for the daemon's life: the worker socket
        looks resends up in it)."""
        self.outbox: list[tuple[list[bytes], bytes]] = []
        """Late replies ready to send: (envelope, reply frame)."""

    def check_room(self, session: Session, op: str, items: Items) -> None:
        """Refuse a request that would take ``session`` or its process past what parked
        requests may keep (see the module's docstring); call it before the ledger queues it.

        Raises:
            BlockPoolExhaustedError: Over a bound; nothing changed.
        """
        kept = kept_bytes(items)
        session_kept = process_kept = process_count = 0
        pid = session.pid
        for parked in self.parked.values():
            other = parked.session
            if other is session:
                session_kept += parked.kept
            if other.pid == pid:
                process_kept += parked.kept
                process_count += 1
        why = None
        if session_kept + kept > WAITING_BYTES_PER_SESSION:
            why = (
                f"this session's waiting requests would keep {format_bytes(session_kept + kept)} "
                f"of the daemon's memory, over the {format_bytes(WAITING_BYTES_PER_SESSION)} "
                "one session's may"
            )
        elif process_count >= WAITING_PER_PROCESS:
            why = (
                f"process {pid} already has {process_count} requests waiting, the most one "
                "process may"
            )
        elif process_kept + kept > WAITING_BYTES_PER_PROCESS:
            why = (
                f"process {pid}'s waiting requests would keep "
                f"{format_bytes(process_kept + kept)} of the daemon's memory, over the "
                f"{format_bytes(WAITING_BYTES_PER_PROCESS)} one process's may"
            )
        if why is not None:
            raise BlockPoolExhaustedError(
                f"{op}: not queued to wait for memory: {why}; retry when some of them are "
                "answered, or ask for fewer items at a time"
            )

    def park(self, parked: ParkedRequest) -> ParkedRequest:
        """Keep an allocation the ledger queued, under its ticket (session id, request id)."""
        self.parked[parked.session.sid, parked.rid] = parked
        return parked

    def session_ended(self, session: Session) -> None:
        """Drop ``session``'s parked allocations, never answered (nobody is left to read them);
        one granted but not yet handed out gives its bytes back."""
        ledger = self._ledger
        if self.parked:
            for ticket in [t for t, p in self.parked.items() if p.session is session]:
                parked = self.parked.pop(ticket)
                if not ledger.cancel(ticket):  # granted, not yet handed out: give it back
                    ledger.credit(session.model, parked.n_bytes)

    # -- answers -------------------------------------------------------------------------------

    def hand_out(self) -> None:
        """Serve the parked allocations the ledger grants now (their replies go to the outbox)."""
        for ticket in self._ledger.grants():
            parked = self.parked.pop(ticket, None)
            if parked is None:  # its session ended after the grant: session_ended credited it
                continue
            try:
                result = self._holdings.perform(
                    parked.session, parked.op, parked.items, parked.n_bytes
                )
            except Exception as exc:
                self._answer(parked, error_reply(parked.rid, self._boot_id, exc))
            else:
                self._answer(parked, encode_result(parked.rid, self._boot_id, result))

    def expire(self, now: float) -> None:
        """Answer POOL_EXHAUSTED to the parked allocations whose deadline passed."""
        expired = self._ledger.expire(now)
        for ticket in expired:
            parked = self.parked.pop(ticket, None)
            if parked is not None:
                self._answer_exhausted(parked, f"waited {parked.wait:g}s")
        if expired:
            self.hand_out()

    def refuse_growth_of(self, sid: int) -> None:
        """Answer POOL_EXHAUSTED now to the growth session ``sid`` has parked, if any: it was
        just asked to give bytes back (a reclaim), which its worker does at its next step
        boundary, after this growth's answer."""
        for ticket, parked in self.parked.items():
            if parked.growth and parked.session.sid == sid:
                if self._ledger.cancel(ticket):
                    del self.parked[ticket]
                    self._answer_exhausted(parked, "asked to give bytes back meanwhile")
                    self.hand_out()
                return

    def cancel(self, session: Session, rid: int) -> bool:
        """Stop waiting for ``session``'s allocation ``rid`` (the ``cancel`` worker op): if it
        still waits it is answered CANCELLED and True is returned; if it was answered already
        (granted, refused, expired, cancelled) False, and nothing changes (a grant is the
        session's to free). A session reaches only its own requests: the ticket is its own.

        Raises:
            BadRequestError: ``session`` has no allocation ``rid`` waiting or answered (never
                received, not an allocation, or answered too long ago); nothing changed.
        """
        ticket = (session.sid, rid)
        parked = self.parked.get(ticket)
        if parked is None:
            if self._replies.lookup(session.sid, rid) is not None:
                return False
            raise BadRequestError(
                f"cancel: request {rid} of this session is not an allocation waiting at the "
                "daemon (never received here, or not one that waits); nothing cancelled"
            )
        if not self._ledger.cancel(ticket):  # granted, not handed out yet: that is its answer
            self.hand_out()
            return False
        del self.parked[ticket]
        exc = RequestCancelledError(
            f"{parked.op}: cancelled by its session after waiting for "
            f"{format_bytes(parked.n_bytes)} for model {parked.session.model!r}; nothing "
            "allocated"
        )
        self._answer(parked, error_reply(rid, self._boot_id, exc))
        self.hand_out()  # it may have held up its model's queue
        return True

    def answer_refused(self, refused: list[tuple[Ticket, Verdict]]) -> int:
        """Answer OVER_BUDGET to parked allocations a settings change made impossible; how many."""
        n = 0
        for ticket, verdict in refused:
            parked = self.parked.pop(ticket, None)
            if parked is not None:
                exc = refusal(self._ledger, parked.op, verdict)
                self._answer(parked, error_reply(parked.rid, self._boot_id, exc))
                n += 1
        return n

    def _answer_exhausted(self, parked: ParkedRequest, why: str) -> None:
        ledger = self._ledger
        model = parked.session.model
        exc = BlockPoolExhaustedError(
            f"{parked.op}: {why} for {format_bytes(parked.n_bytes)} for "
            f"model {model!r}, not granted: the budget "
            f"({budget_text(ledger)}) has "
            f"{format_bytes(ledger.free)} free "
            f"({held_text(ledger)} held; the model holds "
            f"{format_bytes(ledger.held(model))})"
        )
        self._answer(parked, error_reply(parked.rid, self._boot_id, exc))

    def _answer(self, parked: ParkedRequest, reply: bytes) -> None:
        self._replies.remember(parked.session.sid, parked.rid, reply, late=True)
        self.send(parked, reply)

    def send(self, parked: Parked, reply: bytes) -> None:
        """Queue ``reply`` for the newest send of ``parked`` (dropped if none was kept)."""
        if parked.envelope is not None:
            self.outbox.append((parked.envelope, reply))
