"""Check that the daemon answers: its boot id, pid and uptime."""

from __future__ import annotations

from typing import Any

from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.protocol import Field

PARAMS: tuple[Field, ...] = ()


def run(state: DaemonState, args: dict[str, Any]) -> dict[str, Any]:
    coord = state.coord
    return {"boot_id": coord.boot_id, "pid": coord.pid, "uptime_s": coord.uptime()}
