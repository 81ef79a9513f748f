"""The daemon's side of the admin op ``ping``; what it does and takes is declared in
:mod:`vqpool.shared.protocol.admin_ops`."""

from __future__ import annotations

from typing import Any

from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.protocol import ADMIN_ARGS, PING

PARAMS = ADMIN_ARGS[PING]


def run(state: DaemonState, args: dict[str, Any]) -> dict[str, Any]:
    coord = state.coord
    return {"boot_id": coord.boot_id, "pid": coord.pid, "uptime_s": coord.uptime()}
