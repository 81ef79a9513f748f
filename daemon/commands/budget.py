"""The daemon's side of the admin op ``budget``; what it does and takes is declared in
:mod:`vqpool.shared.protocol.admin_ops`."""

from __future__ import annotations

import time
from typing import Any

from vqpool.daemon.coordinator import Coordinator
from vqpool.shared.protocol import ADMIN_ARGS, BUDGET

PARAMS = ADMIN_ARGS[BUDGET]


def run(coord: Coordinator, args: dict[str, Any]) -> dict[str, Any]:
    budget = coord.budget
    refused = budget.set_budget(args["bytes"]) if args["bytes"] else 0
    return budget.view(time.monotonic(), refused)
