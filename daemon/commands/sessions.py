"""The daemon's side of the admin op ``sessions``; what it does and takes is declared in
:mod:`vqpool.shared.protocol.admin_ops`."""

from __future__ import annotations

import time
from typing import Any

from vqpool.daemon.coordinator import Coordinator
from vqpool.daemon.views import session_view
from vqpool.shared.protocol import ADMIN_ARGS, SESSIONS

PARAMS = ADMIN_ARGS[SESSIONS]


def run(coord: Coordinator, args: dict[str, Any]) -> list[dict[str, Any]]:
    now = time.monotonic()
    return [session_view(coord, session, now) for session in coord.sessions]
