"""Worker ops on blocks and owners: allocations (under the memory budget: they may be parked
until it grants them, or their own session cancels them), frees, owners registered and
released, fills, and the claims of a worker re-syncing with a restarted daemon. Those that
change holdings go through the budget (``state.budget``); the others ask the coordinator."""

from __future__ import annotations

from typing import Any

from vqpool.daemon.core.sessions import Session
from vqpool.daemon.ops.op_table import Args
from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.protocol import ALLOCATE, ALLOCATE_MANY, block_rows


def allocate(state: DaemonState, session: Session, args: Args, rid: int, now: float) -> Any:
    return state.budget.allocate(session, ALLOCATE, args, rid, now)


def allocate_many(state: DaemonState, session: Session, args: Args, rid: int, now: float) -> Any:
    return state.budget.allocate(session, ALLOCATE_MANY, args, rid, now)


def free(state: DaemonState, session: Session, args: Args, rid: int, now: float) -> None:
    state.budget.holdings.free(session, args["block_ids"])


def free_all(state: DaemonState, session: Session, args: Args, rid: int, now: float) -> None:
    state.budget.holdings.free_all(session, args["owner"])


def register_owner(state: DaemonState, session: Session, args: Args, rid: int, now: float) -> None:
    state.coord.register_owner(session, args["owner"])


def release_owner(state: DaemonState, session: Session, args: Args, rid: int, now: float) -> None:
    state.coord.release_owner(session, args["owner"])


def blocks_for(
    state: DaemonState, session: Session, args: Args, rid: int, now: float
) -> list[list[Any]]:
    return block_rows(state.coord.blocks_for(session, args["owner"]))


def mark_used(state: DaemonState, session: Session, args: Args, rid: int, now: float) -> None:
    state.coord.mark_used(session, args["updates"])


def claim(
    state: DaemonState, session: Session, args: Args, rid: int, now: float
) -> list[dict[str, Any] | None]:
    return state.budget.holdings.claim(session, args["owners"], args["done"])


def cancel(state: DaemonState, session: Session, args: Args, rid: int, now: float) -> Any:
    return {"cancelled": state.budget.parking.cancel(session, args["request"])}
