"""The daemon's side of the admin op ``sessions``; what it does and takes is declared in
:mod:`vqpool.shared.protocol.admin_ops`."""

from __future__ import annotations

import time
from typing import Any

from vqpool.daemon.core.views import session_view
from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.protocol import ADMIN_ARGS, SESSIONS

PARAMS = ADMIN_ARGS[SESSIONS]


def run(state: DaemonState, args: dict[str, Any]) -> list[dict[str, Any]]:
    coord = state.coord
    now = time.monotonic()
    return [session_view(coord, session, now) for session in coord.sessions]
