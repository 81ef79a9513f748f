"""The daemon's side of the admin op ``budget``; what it does and takes is declared in
:mod:`vqpool.shared.protocol.admin_ops`."""

from __future__ import annotations

import time
from typing import Any

from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.protocol import ADMIN_ARGS, BUDGET

PARAMS = ADMIN_ARGS[BUDGET]


def run(state: DaemonState, args: dict[str, Any]) -> dict[str, Any]:
    budget = state.budget
    refused = budget.set_budget(args["bytes"]) if args["bytes"] else 0
    return budget.view(time.monotonic(), refused)
