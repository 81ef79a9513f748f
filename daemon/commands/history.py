"""Recent allocator stats snapshots, oldest first: one per mutating call (allocate, free,
free_all, shrink), at most the last 256. With LIMIT, only the newest LIMIT."""

from __future__ import annotations

from typing import Any

from vqpool.daemon.coordinator import Coordinator
from vqpool.shared.protocol import Field, check_int, stats_to_wire

PARAMS = (
    Field(
        "limit",
        lambda value, name: check_int(value, name, 1),
        required=False,
        help="newest snapshots to return",
    ),
)


def run(coord: Coordinator, args: dict[str, Any]) -> list[dict[str, int]]:
    snapshots = list(coord.allocator.history)
    if args["limit"] is not None:
        snapshots = snapshots[-args["limit"] :]
    return [stats_to_wire(s) for s in snapshots]
