"""The reclaim path wired into the daemon: workers' long-polls for asks, their answers, and the
loop's turn that plans new asks.

A worker that can give bytes back (a :class:`~vqpool.worker.pool.client.PoolClient` with a reclaim
handler) keeps one ``reclaim_poll`` parked here, on a socket of its own. When the ledger says
bytes are short (:meth:`BudgetLedger.reclaim_need`), :class:`ReclaimBook` picks the sessions to
ask and each ask is the reply to that session's parked poll, sent non-blocking from the loop's
outbox like a granted allocation's: the daemon never waits for a worker. A session with no poll
parked at that moment (it is handling a previous ask, or re-polling) gets its open ask as the
reply to its next poll at once. The worker frees blocks through the usual ``free``/``free_all``
and answers ``reclaim_done``; the ledger's holdings of the session say what it gave back. Only
sessions that have polled are ever asked: a worker without a handler is never waited on.
A model whose limit is set below what it holds (:meth:`ReclaimService.limit_changed`) is asked
for the excess of its own sessions only (``plan_limits``). See docs/protocol.md, "Reclaim".
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection
from typing import Any

from vqpool.daemon.budget.holdings import Holdings
from vqpool.daemon.budget.parking import Parked, Parking
from vqpool.daemon.budget.reclaim_book import (
    DEFAULT_RECLAIM_DEADLINE,
    ReclaimAsk,
    ReclaimBook,
    plan_limits,
    plan_reclaim,
)
from vqpool.daemon.core.coordinator import Coordinator
from vqpool.daemon.core.sessions import Session
from vqpool.shared.byte_sizes import format_bytes
from vqpool.shared.protocol import encode_result

log = logging.getLogger("vqpoold")

PLAN_INTERVAL = 0.005
"""Seconds at least between two plans while requests wait: a plan costs one water-filling, and
an ask answered in less than this is not the bottleneck. A plan is made only when something it
depends on changed (:meth:`ReclaimService.tick`)."""


class ParkedPoll(Parked):
    """A worker's ``reclaim_poll`` waiting for an ask."""

    __slots__ = ("deadline", "rid", "session")

    def __init__(self, session: Session, rid: int, deadline: float) -> None:
        super().__init__()
        self.session = session
        self.rid = rid
        self.deadline = deadline


class ReclaimService:
    """Parked polls, the book of asks, and the loop's share.

    Args:
        coord: The coordinator (sessions, boot id).
        holdings: The sessions' holdings in bytes, and the ledger.
        parking: The parked allocations (a growth of an asked session is answered at once) and
            the outbox of late replies.
        deadline: Seconds a worker has to answer an ask.
    """

    def __init__(
        self,
        coord: Coordinator,
        holdings: Holdings,
        parking: Parking,
        deadline: float = DEFAULT_RECLAIM_DEADLINE,
    ) -> None:
        self._coord = coord
        self._holdings = holdings
        self._ledger = holdings.ledger
        self._parking = parking
        self.book = ReclaimBook(deadline)
        self.polls: dict[int, ParkedPoll] = {}
        self.listeners: set[int] = set()  # sessions that poll: the only ones ever asked
        self._next_plan = 0.0
        self._next_poll_expiry = math.inf  # no parked poll's wait ends before this
        self._over_limit: set[str] = set()  # models set below their holdings, not back under
        self._listeners_version = 0  # bumped when a session starts or stops polling
        self._planned: tuple[int, int, int] | None = None  # what the last plan saw
        self._replan_at = math.inf  # a cool-down ends: the last plan may have skipped it
        self.plans = 0
        """Plans made (each one water-filling): only when something changed."""

    # -- the worker ops ------------------------------------------------------------------------

    def poll(
        self, session: Session, rid: int, wait: float, now: float
    ) -> dict[str, Any] | ParkedPoll:
        """The result of a ``reclaim_poll``: the session's open ask at once, or a parked poll
        (answered with an ask or, at ``now + wait``, with none). One poll per session: a new
        one replaces the old, whose client has moved on; a resend of the parked one (same
        request id) keeps its place."""
        session.reclaimable = True
        if session.sid not in self.listeners:
            self.listeners.add(session.sid)
            self._listeners_version += 1
        ask = self.book.open_ask(session.sid)
        if ask is not None:
            self.polls.pop(session.sid, None)
            return self._ask_result(ask, now)
        parked = self.polls.get(session.sid)
        if parked is not None and parked.rid == rid:
            parked.deadline = now + wait
            return parked
        if wait <= 0:
            self.polls.pop(session.sid, None)
            return {"ask": None}
        parked = self.polls[session.sid] = ParkedPoll(session, rid, now + wait)
        self._next_poll_expiry = min(self._next_poll_expiry, parked.deadline)
        return parked

    def done(self, session: Session, ask_id: int, claimed: int, now: float) -> dict[str, Any]:
        """A ``reclaim_done``: check the answer against the ledger; what counted."""
        held_now = self._holdings.bytes_of_session(session)
        ask, freed = self.book.answer(session.sid, ask_id, claimed, held_now, now)
        if ask is None:
            return {"accepted": False, "freed": 0}
        if claimed > freed:
            log.warning(
                "reclaim: session %s (model %r) says it freed %s for ask %d, but its holdings "
                "fell by %s: the ledger's figure counts",
                session.sid,
                session.model,
                format_bytes(claimed),
                ask.ask_id,
                format_bytes(freed),
            )
        log.info(
            "reclaim: session %s (model %r) gave back %s of %s asked in %.0f ms%s",
            session.sid,
            session.model,
            format_bytes(freed),
            format_bytes(ask.n_bytes),
            (now - ask.asked_at) * 1000,
            " (late)" if ask.late else "",
        )
        return {"accepted": True, "freed": freed, "late": ask.late}

    def note_load(self, session: Session, preemptions: int | None) -> None:
        """A ping's running count of preemptions: the increase since the last one counts."""
        if preemptions is None or preemptions == session.preemptions:
            return
        before = session.preemptions
        # A count that went down is a worker that started counting again: all of it is new.
        self.book.note_preemptions(preemptions - before if preemptions >= before else preemptions)
        session.preemptions = preemptions

    def limit_changed(self, model: str) -> None:
        """``model``'s settings changed live: if it now holds more than its limit, its own
        sessions are asked for the excess until it is back under it."""
        fit = self._ledger.fit(model, 1)
        if fit.held > fit.limit:
            self._over_limit.add(model)

    # -- the loop's share ----------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """Whether :meth:`tick` has anything to do (a session that polls, or an ask open)."""
        return bool(self.listeners) or self.book.n_open > 0

    def tick(self, now: float) -> None:
        """Expire late asks and polls, and ask for what is short (replies go to the outbox)."""
        for ask in self.book.expire(now):
            log.warning(
                "reclaim: session %s (model %r) did not give back %s within %gs: counted late "
                "(its requests go on; others are asked meanwhile)",
                ask.sid,
                ask.model,
                format_bytes(ask.n_bytes),
                self.book.deadline,
            )
        if now >= self._next_poll_expiry:  # one scan per expiry, not per loop turn
            next_expiry = math.inf
            for sid, parked in list(self.polls.items()):
                if parked.deadline <= now:
                    del self.polls[sid]
                    reply = encode_result(parked.rid, self._coord.boot_id, {"ask": None})
                    self._parking.send(parked, reply)
                else:
                    next_expiry = min(next_expiry, parked.deadline)
            self._next_poll_expiry = next_expiry
        if now >= self._next_plan and self.listeners and self._plan_due(now):
            self._next_plan = now + PLAN_INTERVAL
            self._plan(now)
            # What this plan saw, its own asks and refused growths included: the next plan
            # waits for a change of holdings, settings, waiting requests, asks or listeners,
            # or for a cool-down to end.
            self._planned = self._inputs()
            cool_down_end = self.book.next_cool_down_end(now)
            self._replan_at = math.inf if cool_down_end is None else cool_down_end

    def _inputs(self) -> tuple[int, int, int]:
        return (self._ledger.generation, self.book.version, self._listeners_version)

    def _plan_due(self, now: float) -> bool:
        """Whether anything a plan depends on changed since the last one."""
        return now >= self._replan_at or self._inputs() != self._planned

    def next_wake(self, now: float) -> float | None:
        """When :meth:`tick` must run next (None: nothing pending)."""
        times = [self._next_poll_expiry] if self.polls else []
        book_time = self.book.next_deadline()
        if book_time is not None:
            times.append(book_time)
        ledger = self._ledger
        if self.listeners and (ledger.n_waiting or ledger.over_budget or self._over_limit):
            if self._inputs() != self._planned:
                times.append(max(now, self._next_plan))
            elif self._replan_at < math.inf:
                times.append(max(self._replan_at, self._next_plan))
        return min(times) if times else None

    def _plan(self, now: float) -> None:
        ledger = self._ledger
        self.plans += 1

        def holders(models: Collection[str]) -> dict[str, list[tuple[int, int]]]:
            found: dict[str, list[tuple[int, int]]] = {}
            for session in self._coord.sessions:
                if session.reclaimable and session.model in models:
                    held = self._holdings.bytes_of_session(session)
                    found.setdefault(session.model, []).append((session.sid, held))
            return found

        if self._over_limit:
            for ask in plan_limits(ledger, self.book, self._over_limit, holders, now):
                log.info(
                    "reclaim: asking session %s (model %r) for %s by %gs (its model holds "
                    "more than its limit)",
                    ask.sid,
                    ask.model,
                    format_bytes(ask.n_bytes),
                    self.book.deadline,
                )
                self._send_ask(ask, now)
        if not ledger.n_waiting and not ledger.over_budget:
            return
        need, asks = plan_reclaim(ledger, self.book, holders, now)
        for ask in asks:
            log.info(
                "reclaim: asking session %s (model %r) for %s by %gs (short %s for %s)",
                ask.sid,
                ask.model,
                format_bytes(ask.n_bytes),
                self.book.deadline,
                format_bytes(need.short),
                ", ".join(sorted(need.wanted)) or "a budget lowered below holdings",
            )
            self._send_ask(ask, now)

    def _send_ask(self, ask: ReclaimAsk, now: float) -> None:
        """The reply to the asked session's parked poll, if one is parked (else its next poll
        gets the ask at once)."""
        # A session asked to give bytes back does not wait for more: its parked growth is
        # answered now, so its worker's generation thread reaches the ask at once.
        self._parking.refuse_growth_of(ask.sid)
        parked = self.polls.pop(ask.sid, None)
        if parked is not None:
            reply = encode_result(parked.rid, self._coord.boot_id, self._ask_result(ask, now))
            self._parking.send(parked, reply)

    def session_ended(self, session: Session) -> None:
        self.polls.pop(session.sid, None)
        if session.sid in self.listeners:
            self.listeners.discard(session.sid)
            self._listeners_version += 1
        self.book.session_ended(session.sid)

    @staticmethod
    def _ask_result(ask: ReclaimAsk, now: float) -> dict[str, Any]:
        return {"ask": ask.ask_id, "bytes": ask.n_bytes, "deadline": max(0.0, ask.deadline - now)}

    # -- views ---------------------------------------------------------------------------------

    def view(self) -> dict[str, Any]:
        """Counters for ``budget``/``status`` and the metrics."""
        stats = self.book.stats
        return {
            "asked": stats.asked,
            "answered": stats.answered,
            "late": stats.late,
            "bytes_asked": stats.bytes_asked,
            "bytes_reclaimed": stats.bytes_reclaimed,
            "overclaimed": stats.overclaimed,
            "stale_answers": stats.stale_answers,
            "outstanding": self.book.outstanding,
            "latency_p50_s": stats.latency_quantile(0.5),
            "latency_p99_s": stats.latency_quantile(0.99),
            "preemptions": stats.preemptions,
            "deadline_s": self.book.deadline,
            "listening_sessions": len(self.listeners),
            "plans": self.plans,
        }
