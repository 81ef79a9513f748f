"""The byte budget wired into the daemon: bytes charged and credited as blocks change hands, and
allocations parked until the ledger grants them.

The ledger (``daemon/budget.py``) knows bytes per model; this layer turns blocks into bytes (a
block of stream ``s`` costs the holding session's ``bytes_per_block[s]``, 0 when undeclared: such
a session is not bounded) and keeps the requests that wait. An ``allocate`` or
``allocate_many`` with ``wait`` > 0 that the ledger queues gets no reply now: it is *parked*
under its ticket (session id, request id) with the envelope to answer it on, and answered when
the ledger grants it (the allocation is done then) or at its deadline. The server loop sends
those late replies (:attr:`BudgetAccounting.outbox`) and calls :meth:`BudgetAccounting.expire`
and :meth:`BudgetAccounting.hand_out` while anything is parked. See docs/budget.md and
docs/protocol.md.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from vqpool.daemon.budget.ledger import BudgetLedger, bytes_for_context
from vqpool.daemon.budget.reclaim_book import DEFAULT_RECLAIM_DEADLINE
from vqpool.daemon.budget.reclaim_service import ReclaimService
from vqpool.daemon.budget.types import GRANTED, ModelSettings, Outcome, Ticket, Verdict
from vqpool.daemon.budget.views import budget_view, fit_to_wire, is_limited, model_views
from vqpool.daemon.core.error_reply import error_reply
from vqpool.daemon.core.sessions import Session
from vqpool.shared.allocator import Owner
from vqpool.shared.byte_sizes import MAX_BYTES, format_bytes
from vqpool.shared.errors import BlockPoolExhaustedError, OverBudgetError
from vqpool.shared.protocol import ALLOCATE, encode_result

if TYPE_CHECKING:
    from vqpool.daemon.core.coordinator import Coordinator

log = logging.getLogger("vqpoold")

Items = Sequence[tuple[str, int, Owner, str]]


class ParkedRequest:
    """An allocation waiting at the daemon for bytes: what to do once granted, and where the
    reply goes (``envelope``: the routing frames of the newest send of this request, set by
    the server loop)."""

    __slots__ = (
        "deadline",
        "envelope",
        "growth",
        "items",
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
        self.session = session
        self.op = op
        self.items = items
        self.rid = rid
        self.n_bytes = n_bytes
        self.wait = wait
        self.deadline = now + wait
        self.growth = growth
        self.envelope: list[bytes] | None = None


class BudgetAccounting:
    """The daemon's ledger and its parked requests.

    Args:
        coord: The coordinator whose allocator and sessions hold the blocks.
        budget: Bytes all models may hold together, or None for no budget (an unlimited ledger
            that still counts, so per-model limits and views work).
        models: Settings of the configured models.
        lend_reserves: Let models borrow other models' unused reserves (taken back by reclaim).
        reclaim_deadline: Seconds a worker has to answer a reclaim ask.

    Raises:
        ValueError: Reserves summing over the budget, or bad settings.
    """

    def __init__(
        self,
        coord: Coordinator,
        budget: int | None,
        models: Mapping[str, ModelSettings] | None = None,
        *,
        lend_reserves: bool = False,
        reclaim_deadline: float = DEFAULT_RECLAIM_DEADLINE,
    ) -> None:
        self._coord = coord
        self.ledger = BudgetLedger(
            MAX_BYTES if budget is None else budget, models, lend_reserves=lend_reserves
        )
        self._block_size = coord.allocator.config.block_size
        # A shared-kv pool puts every allocation in its one stream whatever name it was asked
        # under ("k" included): blocks are priced by that stream, as they are when freed.
        self._one_stream = None if coord.allocator.config.separate_kv else "kv"
        self.parked: dict[Ticket, ParkedRequest] = {}
        self.outbox: list[tuple[list[bytes], bytes]] = []
        """Replies of parked requests ready to send: (envelope, reply frame)."""
        self.n_refused = 0
        self.reclaim = ReclaimService(coord, self, reclaim_deadline)

    @property
    def limited(self) -> bool:
        """Whether a real budget is set (else every view shows ``budget: null``)."""
        return is_limited(self.ledger)

    # -- hello ---------------------------------------------------------------------------------

    def check_hello(self, bytes_per_block: Mapping[str, int], streams: Sequence[str]) -> None:
        """Refuse a session that the budget could not bound while a budget is set.

        Raises:
            ValueError: A pool stream without bytes per block.
        """
        if self.limited:
            missing = [s for s in streams if s not in bytes_per_block]
            if missing:
                raise ValueError(
                    f"hello: a memory budget is set, so bytes_per_block must be declared for "
                    f"every pool stream ({'+'.join(streams)}); missing: {missing}"
                )

    # -- allocations ---------------------------------------------------------------------------

    def allocate(
        self, session: Session, op: str, args: dict[str, Any], rid: int, now: float
    ) -> Any:
        """``allocate`` / ``allocate_many`` of ``session`` under the budget: the result, or the
        :class:`ParkedRequest` when it waits (no reply now).

        Raises:
            OverBudgetError: It can never fit.
            BlockPoolExhaustedError: Not now and not waiting (``wait`` 0, queues full).
        """
        cost = session.bytes_per_block
        if not cost:  # not bounded by the budget: nothing to count (the hot path without one)
            if op == ALLOCATE:
                return self._coord.allocate(
                    session, args["stream"], args["n_tokens"], args["owner"], args["format"]
                )
            return self._coord.allocate_many(session, args["items"])
        if op == ALLOCATE:
            self._coord.check_allocate(session, args["n_tokens"], args["owner"])
            if not args["wait"]:
                return self._allocate_now(session, args, cost)
        items: Items
        if op == ALLOCATE:
            items = ((args["stream"], args["n_tokens"], args["owner"], args["format"]),)
        else:
            items = args["items"]
        n_bytes = self._bytes_of(items, cost)
        if not n_bytes:
            return self._perform(session, op, items, 0)
        ledger = self.ledger
        wait = args["wait"]
        growth = args["growth"]
        if wait > 0:
            ticket = (session.sid, rid)
            # A growth's party is its session: one growth of each session waits at a time.
            verdict = ledger.request(
                session.model,
                n_bytes,
                ticket,
                now + wait,
                now,
                growth=session.sid if growth else None,
            )
            if verdict.queued:
                parked = self.parked[ticket] = ParkedRequest(
                    session, op, items, rid, n_bytes, wait, now, growth
                )
                return parked
        else:
            verdict = ledger.try_grant(session.model, n_bytes, growth=growth)
        if verdict.outcome is not Outcome.GRANT:
            raise self.refusal(op, verdict)
        return self._perform(session, op, items, n_bytes)

    def _allocate_now(
        self, session: Session, args: dict[str, Any], cost: Mapping[str, int]
    ) -> list[int]:
        """One ``allocate`` that does not wait (the hot path with a budget): its blocks, all
        ceil(n_tokens / block_size) of them when it succeeds, cost exactly what is charged."""
        stream, n_tokens = args["stream"], args["n_tokens"]
        n_bytes = 0
        if n_tokens > 0:
            n_bytes = -(-n_tokens // self._block_size) * self.block_cost(cost, stream)
        ledger = self.ledger
        if n_bytes:
            verdict = ledger.try_grant(session.model, n_bytes, growth=args["growth"])
            if verdict is not GRANTED and verdict.outcome is not Outcome.GRANT:
                raise self.refusal(ALLOCATE, verdict)
        try:
            return self._coord.allocate(session, stream, n_tokens, args["owner"], args["format"])
        except BaseException:
            if n_bytes:
                ledger.credit(session.model, n_bytes)
            raise

    def block_cost(self, cost: Mapping[str, int], stream: str) -> int:
        """Bytes one block costs a session declaring ``cost``, asked for under ``stream``."""
        return cost.get(self._one_stream or stream, 0)

    def _bytes_of(self, items: Items, cost: Mapping[str, int]) -> int:
        block_size = self._block_size
        return sum(
            -(-n_tokens // block_size) * self.block_cost(cost, stream)
            for stream, n_tokens, _, _ in items
            if n_tokens > 0
        )

    def _perform(self, session: Session, op: str, items: Items, charged: int) -> Any:
        """Do the allocation whose ``charged`` bytes the ledger granted; credit back what the
        allocator did not hand out (failed items, a refused request)."""
        coord = self._coord
        try:
            if op == ALLOCATE:
                stream, n_tokens, owner, fmt = items[0]
                result: Any = coord.allocate(session, stream, n_tokens, owner, fmt)
                held = [(stream, result)]
            else:
                result = coord.allocate_many(session, items)
                held = [
                    (item[0], ids)
                    for item, ids in zip(items, result, strict=True)
                    if type(ids) is list
                ]
        except BaseException:
            if charged:
                self.ledger.credit(session.model, charged)
            raise
        if charged or session.bytes_per_block:
            cost = session.bytes_per_block
            spent = (
                sum(len(ids) * self.block_cost(cost, stream) for stream, ids in held) if cost else 0
            )
            if spent < charged:
                self.ledger.credit(session.model, charged - spent)
            elif spent > charged:  # a session with bytes: never happens in practice
                self.ledger.charge(session.model, spent - charged)
        return result

    # -- holdings changed elsewhere ------------------------------------------------------------

    def bytes_of_owner(self, session: Session, owner: Owner) -> int:
        """Bytes the blocks of ``owner`` (held by ``session``) cost now."""
        cost = session.bytes_per_block
        if not cost:
            return 0
        usage = self._coord.allocator.usage(owner)
        return sum(n * cost.get(stream, 0) for stream, (n, _) in usage.items())

    def bytes_of_session(self, session: Session) -> int:
        """Bytes the blocks ``session`` holds cost now (O(its owners))."""
        return sum(self.bytes_of_owner(session, owner) for owner in session.owners)

    def credit(self, session: Session, n_bytes: int) -> None:
        """``session``'s blocks worth ``n_bytes`` were freed.

        The blocks are gone whatever the ledger says: a ledger out of step with them (a
        daemon bug, which ``audit`` reports) is logged and credited what it holds, never
        allowed to fail a free, a goodbye or the reaping of a dead worker."""
        if n_bytes:
            ledger = self.ledger
            try:
                ledger.credit(session.model, n_bytes)
            except ValueError as exc:
                log.error("budget ledger out of step with the pool: %s", exc)
                ledger.credit(session.model, ledger.held(session.model))

    def charge(self, session: Session, n_bytes: int) -> None:
        """``session`` holds blocks worth ``n_bytes`` that it did not allocate (claims)."""
        if n_bytes:
            self.ledger.charge(session.model, n_bytes)

    def session_ended(self, session: Session, n_bytes: int) -> None:
        """``session`` ended, its blocks worth ``n_bytes`` freed: its parked requests are
        dropped (never answered: nobody is left to read them), and a model no session serves
        any more is forgotten unless configured."""
        self.credit(session, n_bytes)
        self.reclaim.session_ended(session)
        ledger = self.ledger
        if self.parked:
            for ticket in [t for t, p in self.parked.items() if p.session is session]:
                parked = self.parked.pop(ticket)
                if not ledger.cancel(ticket):  # granted, not yet handed out: give it back
                    ledger.credit(session.model, parked.n_bytes)
        if not any(s.model == session.model for s in self._coord.sessions):
            ledger.forget_model(session.model)

    # -- the loop's share ----------------------------------------------------------------------

    def hand_out(self) -> None:
        """Serve the parked requests the ledger grants now (their replies go to the outbox)."""
        for ticket in self.ledger.grants():
            parked = self.parked.pop(ticket, None)
            if parked is None:  # its session ended after the grant: session_ended credited it
                continue
            try:
                result = self._perform(parked.session, parked.op, parked.items, parked.n_bytes)
            except Exception as exc:
                self._answer(parked, error_reply(parked.rid, self._coord.boot_id, exc))
            else:
                self._answer(parked, encode_result(parked.rid, self._coord.boot_id, result))

    def expire(self, now: float) -> None:
        """Answer POOL_EXHAUSTED to the parked requests whose deadline passed."""
        expired = self.ledger.expire(now)
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
                if self.ledger.cancel(ticket):
                    del self.parked[ticket]
                    self._answer_exhausted(parked, "asked to give bytes back meanwhile")
                    self.hand_out()
                return

    def _answer_exhausted(self, parked: ParkedRequest, why: str) -> None:
        ledger = self.ledger
        model = parked.session.model
        exc = BlockPoolExhaustedError(
            f"{parked.op}: {why} for {format_bytes(parked.n_bytes)} for "
            f"model {model!r}, not granted: the budget "
            f"({self.budget_text()}) has {format_bytes(self.free_bytes())} free "
            f"({format_bytes(ledger.total_held)} held; the model holds "
            f"{format_bytes(ledger.held(model))})"
        )
        self._answer(parked, error_reply(parked.rid, self._coord.boot_id, exc))

    def answer_refused(self, refused: list[tuple[Ticket, Verdict]]) -> int:
        """Answer OVER_BUDGET to parked requests a settings change made impossible; how many."""
        n = 0
        for ticket, verdict in refused:
            parked = self.parked.pop(ticket, None)
            if parked is not None:
                reply = error_reply(
                    parked.rid, self._coord.boot_id, self.refusal(parked.op, verdict)
                )
                self._answer(parked, reply)
                n += 1
        self.n_refused += n
        return n

    def _answer(self, parked: ParkedRequest, reply: bytes) -> None:
        self._coord.replies.remember(parked.session.sid, parked.rid, reply, late=True)
        if parked.envelope is not None:
            self.outbox.append((parked.envelope, reply))

    # -- settings ------------------------------------------------------------------------------

    def set_budget(self, budget: int) -> int:
        """Change the budget live; parked requests it made impossible are answered (how many)."""
        refused = self.answer_refused(self.ledger.set_budget(budget))
        self.hand_out()
        return refused

    def set_model(self, model: str, settings: ModelSettings) -> int:
        """Change a model's settings live; as :meth:`set_budget`."""
        refused = self.answer_refused(self.ledger.set_model(model, settings))
        self.hand_out()
        return refused

    def refusal(self, op: str, verdict: Verdict) -> Exception:
        """The error of a request that is not granted (now, or ever)."""
        text = f"{op}: memory budget {self.budget_text()}: {verdict.message()}"
        if verdict.outcome is Outcome.NEVER:
            return OverBudgetError(text)
        return BlockPoolExhaustedError(text)

    # -- reads ---------------------------------------------------------------------------------

    def budget_text(self) -> str:
        return format_bytes(self.ledger.budget) if self.limited else "unlimited"

    def free_bytes(self) -> int:
        return max(0, self.ledger.budget - self.ledger.total_held)

    def view(self, now: float, refused: int = 0) -> dict[str, Any]:
        """The ``budget`` admin op's answer, with the reclaim counters."""
        return {**budget_view(self.ledger, now, refused), "reclaim": self.reclaim.view()}

    def model_views(self, now: float) -> list[dict[str, Any]]:
        """The ``model_list`` admin op's views."""
        return model_views(self.ledger, self._coord.sessions, now)

    def model_view(self, name: str, now: float) -> dict[str, Any]:
        """The view of one model the ledger knows or a session serves."""
        return next(v for v in self.model_views(now) if v["model"] == name)

    def fit(
        self, model: str, bytes_per_block: Mapping[str, int], context: int, concurrency: int
    ) -> dict[str, Any]:
        """The fit answer for ``concurrency`` sequences of ``context`` tokens of ``model``."""
        allocator = self._coord.allocator
        per_sequence = bytes_for_context(
            context, allocator.config.block_size, bytes_per_block, allocator.streams
        )
        if per_sequence == 0:
            raise ValueError(
                f"fit: model {model!r} declared 0 bytes per block: the budget does not bound it"
            )
        return fit_to_wire(
            self.ledger, self.ledger.fit(model, per_sequence, concurrency), per_sequence
        )

    def recount_problems(self) -> list[str]:
        """Disagreements between the ledger's bytes per model and a recount from the allocator's
        usage and the sessions' bytes per block (for ``audit``). Granted-but-not-handed-out
        bytes of parked requests count as held."""
        recount: dict[str, int] = {}
        allocator = self._coord.allocator
        for session in self._coord.sessions:
            cost = session.bytes_per_block
            n = 0
            if cost:
                for owner in session.owners:
                    for stream, (n_blocks, _) in allocator.usage(owner).items():
                        n += n_blocks * cost.get(stream, 0)
            recount[session.model] = recount.get(session.model, 0) + n
        ledger = self.ledger
        for parked in self.parked.values():
            if not ledger.is_waiting((parked.session.sid, parked.rid)):
                model = parked.session.model
                recount[model] = recount.get(model, 0) + parked.n_bytes
        problems = []
        for model in sorted(recount.keys() | ledger.snapshot().models.keys()):
            counted, held = recount.get(model, 0), ledger.held(model)
            if counted != held:
                problems.append(
                    f"budget: model {model!r} holds {held} bytes in the ledger but {counted} "
                    "by recount"
                )
        try:
            ledger.check_invariants()
        except AssertionError as exc:
            problems.append(f"budget ledger: {exc}")
        return problems
