"""Every model the budget knows (configured, or served by a live worker): bytes held, reserve,
limit, weight, borrowed (held above the reserve), entitlement, waiting requests and their bytes,
and its workers' sessions and load; with the budget's own view."""

from __future__ import annotations

import time
from typing import Any

from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.protocol import Field

PARAMS: tuple[Field, ...] = ()


def run(state: DaemonState, args: dict[str, Any]) -> dict[str, Any]:
    now = time.monotonic()
    return {"budget": state.budget.view(now), "models": state.budget.model_views(now)}
