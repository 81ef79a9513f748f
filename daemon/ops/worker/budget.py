"""Worker ops with the memory budget: whether sequences would fit, and reclaim (a worker's
long-poll for asks to give bytes back, and its answer)."""

from __future__ import annotations

import time
from typing import Any

from vqpool.daemon.core.sessions import Session
from vqpool.daemon.ops.op_table import Args
from vqpool.daemon.ops.state import DaemonState


def fit(state: DaemonState, session: Session, args: Args, rid: int, now: float) -> dict[str, Any]:
    return state.budget.fit(
        session.model, session.bytes_per_block, args["context"], args["concurrency"]
    )


def reclaim_poll(state: DaemonState, session: Session, args: Args, rid: int, now: float) -> Any:
    return state.budget.reclaim.poll(session, rid, args["wait"], now)


def reclaim_done(
    state: DaemonState, session: Session, args: Args, rid: int, now: float
) -> dict[str, Any]:
    return state.budget.reclaim.done(session, args["ask"], args["freed"], time.monotonic())
