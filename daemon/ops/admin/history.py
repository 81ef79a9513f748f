"""The daemon's side of the admin op ``history``; what it does and takes is declared in
:mod:`vqpool.shared.protocol.admin_ops`."""

from __future__ import annotations

from typing import Any

from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.allocator import AllocationStats
from vqpool.shared.protocol import ADMIN_ARGS, HISTORY, stats_to_wire

PARAMS = ADMIN_ARGS[HISTORY]


def run(state: DaemonState, args: dict[str, Any]) -> list[dict[str, Any]]:
    coord = state.coord
    if args["timeline"]:
        return coord.timeline.to_wire(args["limit"])
    rows = coord.history_clock.rows(coord.allocator)
    if args["limit"] is not None:
        rows = rows[-args["limit"] :]
    # Each row: the seed's AllocationStats fields, and the wall-clock time the daemon recorded
    # it at (seconds since the epoch; added beside them, so older readers ignore it).
    return [{**stats_to_wire(AllocationStats(*row)), "time": when} for when, row in rows]
