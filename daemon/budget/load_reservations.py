"""Pending load reservations: a model's weights charged before its worker exists.

The front door asks the ledger for a model's weights before it starts the model's worker
(``load_reserve``); the reservation holds the weights until the worker's ``hello`` takes it over
(the weights become the session's charge in the same step), the front door gives it back
(``load_release``), or its time to live passes. This module keeps the pending ones, their
order per model (the oldest is taken over first) and their deadlines; the ledger keeps the
bytes (under :func:`reservation_key`). Pure bookkeeping: no I/O, times are passed in.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from vqpool.shared.protocol import MAX_LOAD_RESERVATIONS


@dataclass(frozen=True, slots=True)
class LoadReservation:
    """One pending load: ``weights`` bytes of ``model`` and its worker's ``overhead`` charged
    under its ticket until ``deadline`` (monotonic)."""

    ticket: str
    model: str
    weights: int
    kv_min: int
    deadline: float
    overhead: int = 0


def reservation_key(ticket: str) -> tuple[str, str]:
    """The ledger's holder key of a reservation's weights (a session's is ``session_key``)."""
    return ("load", ticket)


class LoadReservations:
    """The pending load reservations, oldest first, at most :data:`MAX_LOAD_RESERVATIONS`."""

    def __init__(self) -> None:
        self.pending: dict[str, LoadReservation] = {}  # insertion order: oldest first

    def check_room(self) -> None:
        """Raises ValueError when as many reservations are pending as allowed."""
        if len(self.pending) >= MAX_LOAD_RESERVATIONS:
            raise ValueError(
                f"load_reserve: {len(self.pending)} load reservations are pending, the most "
                "allowed; release or let some expire first"
            )

    def new_ticket(self) -> str:
        """A ticket no pending reservation has."""
        ticket = secrets.token_hex(8)
        while ticket in self.pending:
            ticket = secrets.token_hex(8)
        return ticket

    def add(
        self,
        ticket: str,
        model: str,
        weights: int,
        kv_min: int,
        deadline: float,
        overhead: int = 0,
    ) -> LoadReservation:
        """Keep a new pending reservation under ``ticket`` (from :meth:`new_ticket`)."""
        self.check_room()
        found = self.pending[ticket] = LoadReservation(
            ticket, model, weights, kv_min, deadline, overhead
        )
        return found

    def pop(self, ticket: str) -> LoadReservation | None:
        """Remove and return the reservation of ``ticket`` (None: not pending)."""
        return self.pending.pop(ticket, None)

    def pop_oldest(self, model: str) -> LoadReservation | None:
        """Remove and return ``model``'s oldest pending reservation (None: it has none)."""
        for ticket, found in self.pending.items():
            if found.model == model:
                del self.pending[ticket]
                return found
        return None

    def expire(self, now: float) -> list[LoadReservation]:
        """Remove and return the reservations whose deadline is ``<= now``."""
        gone = [found for found in self.pending.values() if found.deadline <= now]
        for found in gone:
            del self.pending[found.ticket]
        return gone
