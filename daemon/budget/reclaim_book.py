"""Cooperative reclaim: which worker sessions are asked to give bytes back, by when, and what
they actually gave.

Pure bookkeeping like the ledger (no I/O, times passed in), so the daemon and the simulator of
``scripts/bench_elastic.py`` drive the same code. The ledger says how many bytes are short and
which models hold more than their share (:meth:`BudgetLedger.reclaim_need`); this book turns
that into *asks* to the sessions of those models that can answer (those that poll for asks),
never more than is short and not already asked for, and checks each answer against the ledger:
the bytes a session's holdings fell since it was asked are what it gave back, whatever it
claims. An ask not answered by its deadline is *late*: counted and logged by the caller, never
punished; its session is not asked again until it answers or a cool-down passes, and the bytes
are asked of others meanwhile.

Hysteresis (:func:`plan_reclaim`): a model at or above its reserve is owed bytes for its fair
share only while it is short of it by more than a margin, and a session that just answered is
not asked again for fair shares within a cool-down; reserves are restored at once whatever the
margin and cool-downs say. See docs/budget.md, "Reclaim".
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, MutableSet
from dataclasses import dataclass, field

from vqpool.daemon.budget.ledger import BudgetLedger
from vqpool.daemon.budget.types import ReclaimNeed

__all__ = [
    "DEFAULT_RECLAIM_COOL_DOWN",
    "DEFAULT_RECLAIM_DEADLINE",
    "DEFAULT_RECLAIM_MARGIN",
    "LATENCY_SAMPLES",
    "ReclaimAsk",
    "ReclaimBook",
    "ReclaimStats",
    "plan_limits",
    "plan_reclaim",
]

DEFAULT_RECLAIM_DEADLINE = 1.0
"""Seconds a worker has to give bytes back: a few decode steps and a preemption at a step
boundary take tens of milliseconds; a second leaves room for a long prefill step in flight."""

DEFAULT_RECLAIM_MARGIN = 0.1
"""Fair-share hysteresis: a model above its reserve is owed bytes for its share only while it
holds less than 90% of it (:meth:`BudgetLedger.reclaim_need`)."""

DEFAULT_RECLAIM_COOL_DOWN = 0.5
"""Seconds after answering an ask during which a session is not asked again for fair shares
(reserves do not wait for it): at most two such asks a second per session."""

LATENCY_SAMPLES = 1024
"""Answer latencies kept for the p50/p99 (the most recent ones)."""


@dataclass(slots=True, eq=False)
class ReclaimAsk:
    """One ask to one session: give back ``n_bytes`` by ``deadline``.

    ``held_at_ask`` is what the session held (in the ledger's bytes) when asked: what it holds
    at its answer is compared with it. ``late`` is set when the deadline passed unanswered.
    """

    ask_id: int
    sid: int
    model: str
    n_bytes: int
    asked_at: float
    deadline: float
    held_at_ask: int
    late: bool = False


@dataclass(slots=True)
class ReclaimStats:
    """Counters since the daemon started (bytes throughout)."""

    asked: int = 0
    answered: int = 0
    late: int = 0
    bytes_asked: int = 0
    bytes_reclaimed: int = 0
    overclaimed: int = 0
    """Answers that claimed more bytes than the session's holdings fell by (the ledger wins)."""
    stale_answers: int = 0
    """Answers naming no open ask of the session (already answered, or forgotten)."""
    preemptions: int = 0
    """Requests the workers said they preempted (the sum of their reports)."""
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_SAMPLES))

    def latency_quantile(self, q: float) -> float | None:
        """The ``q`` quantile of the kept answer latencies in seconds (None: no answer yet)."""
        if not self.latencies:
            return None
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class ReclaimBook:
    """The open asks and the counters.

    Args:
        deadline: Seconds a session has to answer an ask.
        cool_down: Seconds after an answer during which :meth:`plan` with ``cool`` True does
            not ask that session again.
    """

    def __init__(
        self,
        deadline: float = DEFAULT_RECLAIM_DEADLINE,
        cool_down: float = DEFAULT_RECLAIM_COOL_DOWN,
    ) -> None:
        if not 0 < deadline <= 60:
            raise ValueError(f"reclaim deadline must be in (0, 60] seconds, got {deadline!r}")
        if not 0 <= cool_down <= 60:
            raise ValueError(f"reclaim cool-down must be in [0, 60] seconds, got {cool_down!r}")
        self.deadline = deadline
        self.cool_down = cool_down
        self.stats = ReclaimStats()
        self._ids = itertools.count(1)
        self._by_session: dict[int, ReclaimAsk] = {}
        self._open_bytes = 0  # bytes of the asks not answered and not late
        self._answered_at: dict[int, float] = {}  # sessions in their cool-down: when they answered
        self.version = 0
        """Bumped whenever an ask is made, answered, turns late or is dropped."""

    def open_ask(self, sid: int) -> ReclaimAsk | None:
        """The ask ``sid`` has not answered (late or not), if any."""
        return self._by_session.get(sid)

    @property
    def n_open(self) -> int:
        """Asks not answered yet (late ones in their cool-down included)."""
        return len(self._by_session)

    @property
    def outstanding(self) -> int:
        """Bytes asked and still expected (not answered, not late)."""
        return self._open_bytes

    def cooling(self, sid: int, now: float) -> bool:
        """Whether ``sid`` answered an ask less than :attr:`cool_down` seconds ago."""
        answered = self._answered_at.get(sid)
        return answered is not None and now < answered + self.cool_down

    def plan(
        self,
        need: ReclaimNeed,
        holders: Mapping[str, Iterable[tuple[int, int]]],
        now: float,
        *,
        cool: bool = False,
    ) -> list[ReclaimAsk]:
        """New asks for what ``need`` says is short beyond what is already asked.

        Args:
            need: The ledger's answer.
            holders: Per model, ``(session id, bytes it holds)`` of its sessions that can be
                asked (they poll for asks).
            now: Monotonic time.
            cool: Skip the sessions in their cool-down (:meth:`cooling`): for fair shares,
                not for reserves.

        Returns:
            The new asks, largest weighted excess first; within a model, the sessions holding
            most first. A session with an open ask is not asked again.
        """
        if self._answered_at:  # forget cool-downs that are over (bounded by the sessions)
            self._answered_at = {
                sid: t for sid, t in self._answered_at.items() if now < t + self.cool_down
            }
        remaining = need.short - self._open_bytes
        if remaining <= 0:
            return []
        asked_of: dict[str, int] = {}
        for ask in self._by_session.values():
            if not ask.late:
                asked_of[ask.model] = asked_of.get(ask.model, 0) + ask.n_bytes
        new: list[ReclaimAsk] = []
        for model, excess in need.excess:
            take = min(excess - asked_of.get(model, 0), remaining)
            if take <= 0:
                continue
            for sid, held in sorted(holders.get(model, ()), key=lambda h: (-h[1], h[0])):
                if take <= 0:
                    break
                if sid in self._by_session or held <= 0 or (cool and self.cooling(sid, now)):
                    continue
                n = min(take, held)
                ask = ReclaimAsk(next(self._ids), sid, model, n, now, now + self.deadline, held)
                self._by_session[sid] = ask
                self._open_bytes += n
                self.stats.asked += 1
                self.stats.bytes_asked += n
                take -= n
                remaining -= n
                new.append(ask)
                self.version += 1
            if remaining <= 0:
                break
        return new

    def answer(
        self, sid: int, ask_id: int, claimed: int, held_now: int, now: float
    ) -> tuple[ReclaimAsk | None, int]:
        """Session ``sid`` answers ask ``ask_id``, claiming ``claimed`` bytes freed; it holds
        ``held_now`` bytes in the ledger now.

        Returns:
            The ask (None: no such open ask of this session, counted as stale) and the bytes
            it gave back by the ledger: how far its holdings fell since the ask.
        """
        ask = self._by_session.get(sid)
        if ask is None or ask.ask_id != ask_id:
            self.stats.stale_answers += 1
            return None, 0
        self._close(ask)
        self._answered_at[sid] = now
        freed = max(0, ask.held_at_ask - held_now)
        stats = self.stats
        stats.answered += 1
        stats.bytes_reclaimed += freed
        if claimed > freed:
            stats.overclaimed += 1
        stats.latencies.append(max(0.0, now - ask.asked_at))
        return ask, freed

    def expire(self, now: float) -> list[ReclaimAsk]:
        """Mark the asks whose deadline passed unanswered as late (returned, to log); drop late
        asks after a cool-down of one more deadline, so their session may be asked again."""
        late = []
        for ask in list(self._by_session.values()):
            if ask.late:
                if now >= ask.deadline + self.deadline:
                    del self._by_session[ask.sid]
                    self.version += 1
            elif now >= ask.deadline:
                self.version += 1
                ask.late = True
                self._open_bytes -= ask.n_bytes
                self.stats.late += 1
                late.append(ask)
        return late

    def next_deadline(self) -> float | None:
        """When :meth:`expire` has something to do next (None: no ask is open)."""
        cool_down = self.deadline
        times = [
            a.deadline + cool_down if a.late else a.deadline for a in self._by_session.values()
        ]
        return min(times) if times else None

    def session_ended(self, sid: int) -> None:
        """Forget ``sid``'s ask: its blocks were freed with it."""
        self._answered_at.pop(sid, None)
        ask = self._by_session.get(sid)
        if ask is not None:
            self._close(ask)

    def note_preemptions(self, n: int) -> None:
        """A worker reported ``n`` more preemptions."""
        if n > 0:
            self.stats.preemptions += n

    def next_cool_down_end(self, now: float) -> float | None:
        """When the earliest cool-down still running at ``now`` ends (a session that may be
        asked again then)."""
        ends = [t + self.cool_down for t in self._answered_at.values() if t + self.cool_down > now]
        return min(ends) if ends else None

    def _close(self, ask: ReclaimAsk) -> None:
        self.version += 1
        del self._by_session[ask.sid]
        if not ask.late:
            self._open_bytes -= ask.n_bytes


def plan_reclaim(
    ledger: BudgetLedger,
    book: ReclaimBook,
    holders: Callable[[Collection[str]], Mapping[str, Iterable[tuple[int, int]]]],
    now: float,
    *,
    up_to_share: bool = True,
    margin: float = DEFAULT_RECLAIM_MARGIN,
) -> tuple[ReclaimNeed, list[ReclaimAsk]]:
    """The asks to make now: first for the reserves (any session above its share, cool-downs
    ignored: a reserve is a guarantee), then, with ``up_to_share``, for fair shares past the
    ``margin`` (sessions in their cool-down skipped). The daemon and the simulator of
    ``scripts/bench_elastic.py`` both plan through here.

    Args:
        holders: Given the names of the models above their share, per model the
            ``(session id, bytes held)`` of its sessions that can be asked.

    Returns:
        The larger need (for the log line) and the new asks.
    """
    need = ledger.reclaim_need(up_to_share=False)
    asks: list[ReclaimAsk] = []
    if need.short > book.outstanding:
        asks += book.plan(need, holders([name for name, _ in need.excess]), now)
    if up_to_share:
        share_need = ledger.reclaim_need(margin=margin)
        if share_need.short > book.outstanding:
            found = holders([name for name, _ in share_need.excess])
            asks += book.plan(share_need, found, now, cool=True)
        if share_need.short > need.short:
            need = share_need
    return need, asks


def plan_limits(
    ledger: BudgetLedger,
    book: ReclaimBook,
    over_limit: MutableSet[str],
    holders: Callable[[Collection[str]], Mapping[str, Iterable[tuple[int, int]]]],
    now: float,
) -> list[ReclaimAsk]:
    """The asks that bring models whose limit was lowered below their holdings back under it:
    each of ``over_limit`` is asked for what it holds above its limit, of *its own* sessions
    only (another model's bytes do not lower its holdings: taking them would serve nobody),
    cool-downs kept. Models back within their limit leave ``over_limit``.

    A worker answers an ask from its prompt cache first, then by preempting its own requests;
    a request of the model waiting meanwhile is served once the model is back under its limit
    with room for it (the cache advice, ``daemon/ops/worker/sessions.py``, gives that room
    from the model's cache).
    """
    excess: list[tuple[str, int]] = []
    for model in list(over_limit):
        fit = ledger.fit(model, 1)
        if fit.held <= fit.limit:
            over_limit.discard(model)
        else:
            excess.append((model, fit.held - fit.limit))
    if not excess:
        return []
    need = ReclaimNeed(sum(n for _, n in excess), {}, excess)
    return book.plan(need, holders([model for model, _ in excess]), now, cool=True)
