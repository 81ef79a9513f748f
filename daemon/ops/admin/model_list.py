"""The daemon's side of the admin op ``model_list``; what it does and takes is declared in
:mod:`vqpool.shared.protocol.admin_ops`."""

from __future__ import annotations

import time
from typing import Any

from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.protocol import ADMIN_ARGS, MODEL_LIST

PARAMS = ADMIN_ARGS[MODEL_LIST]


def run(state: DaemonState, args: dict[str, Any]) -> dict[str, Any]:
    now = time.monotonic()
    return {"budget": state.budget.view(now), "models": state.budget.model_views(now)}
