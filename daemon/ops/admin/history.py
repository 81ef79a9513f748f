"""Recent allocator stats snapshots, oldest first: one per mutating call (allocate, free,
free_all, shrink), at most the last 256. With LIMIT, only the newest LIMIT. With TIMELINE, the
daemon's per-stream timeline instead: blocks in use and total per stream with wall-clock times,
sampled every 0.25 s while the pool changes (at most 3600 samples)."""

from __future__ import annotations

from typing import Any

from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.protocol import Field, check_bool, check_int, stats_to_wire

PARAMS = (
    Field(
        "limit",
        lambda value, name: check_int(value, name, 1),
        required=False,
        help="newest snapshots to return",
    ),
    Field(
        "timeline",
        check_bool,
        required=False,
        default=False,
        help="return the per-stream timeline instead of the allocator snapshots",
    ),
)


def run(state: DaemonState, args: dict[str, Any]) -> list[dict[str, Any]]:
    coord = state.coord
    if args["timeline"]:
        return coord.timeline.to_wire(args["limit"])
    snapshots = list(coord.allocator.history)
    if args["limit"] is not None:
        snapshots = snapshots[-args["limit"] :]
    return [stats_to_wire(s) for s in snapshots]
