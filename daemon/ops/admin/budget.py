"""Show the memory budget, or set it live with BYTES: bytes held in all, free, reserved,
unused reserves (protected), requests waiting. Lowering it below what is held takes nothing
back: nothing more is granted until holdings fall under it. Waiting requests the change made
impossible are refused (OVER_BUDGET); ``refused`` says how many."""

from __future__ import annotations

import time
from typing import Any

from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.byte_sizes import MAX_BYTES
from vqpool.shared.protocol import Field, check_int

PARAMS = (
    Field(
        "bytes",
        lambda v, n: check_int(v, n, 0, MAX_BYTES),
        required=False,
        default=0,
        help="the new budget in bytes (absent or 0: just show it)",
    ),
)


def run(state: DaemonState, args: dict[str, Any]) -> dict[str, Any]:
    budget = state.budget
    refused = budget.set_budget(args["bytes"]) if args["bytes"] else 0
    return budget.view(time.monotonic(), refused)
