"""The daemon's side of the admin op ``history``; what it does and takes is declared in
:mod:`vqpool.shared.protocol.admin_ops`."""

from __future__ import annotations

from typing import Any

from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.protocol import ADMIN_ARGS, HISTORY, stats_to_wire

PARAMS = ADMIN_ARGS[HISTORY]


def run(state: DaemonState, args: dict[str, Any]) -> list[dict[str, Any]]:
    coord = state.coord
    if args["timeline"]:
        return coord.timeline.to_wire(args["limit"])
    snapshots = list(coord.allocator.history)
    if args["limit"] is not None:
        snapshots = snapshots[-args["limit"] :]
    return [stats_to_wire(s) for s in snapshots]
