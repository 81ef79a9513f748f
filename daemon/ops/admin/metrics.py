"""The daemon's side of the admin op ``metrics``; what it does and takes is declared in
:mod:`vqpool.shared.protocol.admin_ops`."""

from __future__ import annotations

from typing import Any

from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.protocol import ADMIN_ARGS, METRICS

PARAMS = ADMIN_ARGS[METRICS]


def run(state: DaemonState, args: dict[str, Any]) -> str:
    coord = state.coord
    return coord.allocator.stats.to_prometheus()
