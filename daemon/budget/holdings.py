"""The sessions' holdings in bytes: what blocks cost, and the ledger kept in step as the
coordinator hands blocks out and takes them back.

A block of stream ``s`` and format ``f`` costs the holding session's ``bytes_per_format[f][s]``
when it declared that format, else its ``bytes_per_block[s]`` (0 when undeclared: a session that
declares no bytes is not bounded by the budget). Each change of holdings that moves bytes is done
here: an allocation the ledger granted (:meth:`Holdings.perform`), a free, a claim after a
restart (admitted by the ledger as an allocation would be), the end of a session. This layer
calls the coordinator for the blocks, which answers in blocks per (stream, format), and charges
or credits the ledger their bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from vqpool.daemon.budget.ledger import BudgetLedger
from vqpool.daemon.budget.types import GRANTED, Outcome, Reason, Verdict
from vqpool.daemon.budget.views import budget_text, refusal
from vqpool.daemon.core.coordinator import Coordinator, FormatCounts, SessionEnd
from vqpool.daemon.core.sessions import Session
from vqpool.shared.allocator import Owner
from vqpool.shared.byte_sizes import format_bytes
from vqpool.shared.errors import OverBudgetError
from vqpool.shared.protocol import ALLOCATE, ClaimGroup

log = logging.getLogger("vqpoold")

Items = Sequence[tuple[str, int, Owner, str]]
"""The items of an allocation: (stream, n_tokens, owner, format) each."""


class Holdings:
    """Blocks priced in bytes, and every change of them charged or credited to the ledger.

    Args:
        coord: The coordinator whose allocator and sessions hold the blocks.
        ledger: The budget's ledger.
    """

    def __init__(self, coord: Coordinator, ledger: BudgetLedger) -> None:
        self._coord = coord
        self.ledger = ledger
        self._block_size = coord.allocator.config.block_size
        # A shared-kv pool puts every allocation in its one stream whatever name it was asked
        # under ("k" included): blocks are priced by that stream, as they are when freed.
        self._one_stream = None if coord.allocator.config.separate_kv else "kv"

    # -- prices --------------------------------------------------------------------------------

    def block_cost(self, session: Session, stream: str, fmt: str) -> int:
        """Bytes one block of format ``fmt`` costs ``session``, asked for under ``stream``."""
        return session.block_bytes(self._one_stream or stream, fmt)

    def bytes_of(self, items: Items, session: Session) -> int:
        """Bytes the blocks of an allocation's ``items`` cost ``session``."""
        block_size = self._block_size
        return sum(
            -(-n_tokens // block_size) * self.block_cost(session, stream, fmt)
            for stream, n_tokens, _, fmt in items
            if n_tokens > 0
        )

    def bytes_of_owner(self, session: Session, owner: Owner) -> int:
        """Bytes the blocks of ``owner`` (held by ``session``) cost now."""
        if not is_priced(session):
            return 0
        return self.bytes_held(self._coord.allocator.format_usage(owner), session)

    def bytes_of_session(self, session: Session) -> int:
        """Bytes the blocks ``session`` holds cost now (O(its owners))."""
        return sum(self.bytes_of_owner(session, owner) for owner in session.owners)

    def bytes_held(self, counts: FormatCounts, session: Session) -> int:
        """Bytes ``session``'s blocks counted per (stream, format) cost."""
        n_bytes = 0
        for (stream, fmt), n in counts.items():  # a loop, not sum(): on every free's path
            n_bytes += n * self.block_cost(session, stream, fmt)
        return n_bytes

    # -- allocations ---------------------------------------------------------------------------

    def allocate_now(self, session: Session, args: dict[str, Any]) -> list[int]:
        """One ``allocate`` that does not wait (the hot path with a budget): its blocks, all
        ceil(n_tokens / block_size) of them when it succeeds, cost exactly what is charged.

        Raises:
            OverBudgetError: It can never fit.
            BlockPoolExhaustedError: Not now.
        """
        stream, n_tokens, fmt = args["stream"], args["n_tokens"], args["format"]
        n_bytes = 0
        if n_tokens > 0:
            n_bytes = -(-n_tokens // self._block_size) * self.block_cost(session, stream, fmt)
        ledger = self.ledger
        if n_bytes:
            verdict = ledger.try_grant(session.model, n_bytes, growth=args["growth"])
            if verdict is not GRANTED and verdict.outcome is not Outcome.GRANT:
                raise refusal(ledger, ALLOCATE, verdict)
        try:
            return self._coord.allocate(session, stream, n_tokens, args["owner"], fmt)
        except BaseException:
            if n_bytes:
                ledger.credit(session.model, n_bytes)
            raise

    def perform(self, session: Session, op: str, items: Items, charged: int) -> Any:
        """Do the allocation whose ``charged`` bytes the ledger granted; credit back what the
        allocator did not hand out (failed items, a refused request)."""
        coord = self._coord
        try:
            if op == ALLOCATE:
                stream, n_tokens, owner, fmt = items[0]
                result: Any = coord.allocate(session, stream, n_tokens, owner, fmt)
                held = [(stream, fmt, result)]
            else:
                result = coord.allocate_many(session, items)
                held = [
                    (item[0], item[3], ids)
                    for item, ids in zip(items, result, strict=True)
                    if type(ids) is list
                ]
        except BaseException:
            if charged:
                self.ledger.credit(session.model, charged)
            raise
        if charged or is_priced(session):
            spent = sum(
                len(ids) * self.block_cost(session, stream, fmt) for stream, fmt, ids in held
            )
            if spent < charged:
                self.ledger.credit(session.model, charged - spent)
            elif spent > charged:  # a session with bytes: never happens in practice
                self.ledger.charge(session.model, spent - charged)
        return result

    # -- frees, claims and ends ----------------------------------------------------------------

    def free(self, session: Session, block_ids: Sequence[int]) -> None:
        """``free`` of blocks by id (see :meth:`Coordinator.free`), credited."""
        priced = is_priced(session)
        freed = self._coord.free(session, block_ids, priced)
        if priced:
            self.credit(session, self.bytes_held(freed, session))

    def free_all(self, session: Session, owner: Owner) -> None:
        """``free_all`` of an owner (see :meth:`Coordinator.free_all`), credited."""
        priced = is_priced(session)
        freed = self._coord.free_all(session, owner, priced)
        if priced:
            self.credit(session, self.bytes_held(freed, session))

    def claim(
        self, session: Session, owners: Sequence[tuple[Owner, list[ClaimGroup]]], done: bool
    ) -> list[dict[str, Any] | None]:
        """``claim`` (see :meth:`Coordinator.claim`), each owner's blocks admitted by the
        ledger as an allocation of theirs would be (:meth:`admit_claim`)."""
        admit = self.admit_claim if is_priced(session) else None
        return self._coord.claim(session, owners, done, admit)

    def admit_claim(
        self, session: Session, owner: Owner, counts: FormatCounts
    ) -> Callable[[], None]:
        """Charge the bytes of an owner's claim if the ledger would grant them as an allocation
        (the budget, the model's limit, other models' unused reserves); the undo.

        A restarted daemon with the options its predecessor had (and the live settings it
        kept) has the same ledger, which granted every block its workers hold; and the claims
        of a claim period only add to holdings, so each one fits whatever order they come in
        (each rule compares against holdings no larger than the predecessor's). A claim that
        does not fit is for blocks the ledger would not have granted: refused, so that a claim
        never gets around the budget (docs/budget.md).

        Raises:
            OverBudgetError: It does not fit; nothing was charged.
        """
        n_bytes = self.bytes_held(counts, session)
        model = session.model
        ledger = self.ledger
        if n_bytes:
            verdict = ledger.try_grant(model, n_bytes)
            if verdict is not GRANTED and verdict.outcome is not Outcome.GRANT:
                raise OverBudgetError(
                    f"claim: owner {owner!r}: its {sum(counts.values())} block(s) "
                    f"({format_bytes(n_bytes)}) do not fit the memory budget "
                    f"({budget_text(ledger)}): {_claim_shortage(verdict)}; its blocks were not "
                    "taken back (a claim gets no more than an allocation would)"
                )

        def undo() -> None:
            if n_bytes:
                ledger.credit(model, n_bytes)

        return undo

    def end_session(self, session: Session) -> SessionEnd:
        """End ``session`` in the coordinator (its blocks freed, its owners released), credited."""
        priced = is_priced(session)
        ended = self._coord.end_session(session, priced)
        if priced:
            self.credit(session, self.bytes_held(ended.counts, session))
        return ended

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


def is_priced(session: Session) -> bool:
    """Whether ``session`` declared bytes for its blocks (else the budget does not bound it)."""
    return bool(session.bytes_per_block or session.bytes_per_format)


def _claim_shortage(verdict: Verdict) -> str:
    """Which rule of the ledger a claim's bytes break, with the numbers."""
    fb = format_bytes
    reason = verdict.reason
    if reason in (Reason.OWN_LIMIT, Reason.OVER_LIMIT):
        return f"model {verdict.model!r} would hold more than its {fb(verdict.limit)} limit"
    if reason in (Reason.RESERVES_PROTECTED, Reason.OVER_CEILING):
        return (
            f"{fb(verdict.protected)} of the free bytes are other models' unused reserves, "
            f"which model {verdict.model!r} may not take"
        )
    free = max(0, verdict.budget - verdict.total_held - verdict.total_weights)
    held = fb(verdict.total_held)
    if verdict.total_weights:
        held = f"{held} of KV and {fb(verdict.total_weights)} of weights"
    return f"the budget has {fb(free)} free ({held} held)"
