"""Worker ops that read the pool: free blocks of a stream, the allocator's counters, their
recent history, and the same counters in the Prometheus text format."""

from __future__ import annotations

from typing import Any

from vqpool.daemon.core.sessions import Session
from vqpool.daemon.ops.op_table import Args
from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.protocol import stats_to_wire


def n_free(state: DaemonState, session: Session, args: Args, rid: int, now: float) -> int:
    return state.coord.allocator.n_free(args["stream"])


def stats(state: DaemonState, session: Session, args: Args, rid: int, now: float) -> dict[str, Any]:
    return stats_to_wire(state.coord.allocator.stats)


def history(
    state: DaemonState, session: Session, args: Args, rid: int, now: float
) -> list[dict[str, Any]]:
    return [stats_to_wire(s) for s in state.coord.allocator.history]


def metrics(state: DaemonState, session: Session, args: Args, rid: int, now: float) -> str:
    return state.coord.allocator.stats.to_prometheus()
