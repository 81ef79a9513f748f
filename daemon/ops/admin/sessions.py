"""List worker sessions: pid, model, process state, blocks and bytes held per stream, owners,
seconds since last heard and lease state."""

from __future__ import annotations

import time
from typing import Any

from vqpool.daemon.core.views import session_view
from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.protocol import Field

PARAMS: tuple[Field, ...] = ()


def run(state: DaemonState, args: dict[str, Any]) -> list[dict[str, Any]]:
    coord = state.coord
    now = time.monotonic()
    return [session_view(coord, session, now) for session in coord.sessions]
