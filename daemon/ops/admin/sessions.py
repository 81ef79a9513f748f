"""List worker sessions: pid, model, process state, blocks and bytes held per stream, owners,
seconds since last heard and lease state."""

from __future__ import annotations

import time
from typing import Any

from vqpool.daemon.core.coordinator import Coordinator
from vqpool.daemon.core.views import session_view
from vqpool.shared.protocol import Field

PARAMS: tuple[Field, ...] = ()


def run(coord: Coordinator, args: dict[str, Any]) -> list[dict[str, Any]]:
    now = time.monotonic()
    return [session_view(coord, session, now) for session in coord.sessions]
