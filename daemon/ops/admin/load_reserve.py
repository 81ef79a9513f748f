"""The daemon's side of the admin op ``load_reserve``; what it does and takes is declared in
:mod:`vqpool.shared.protocol.admin_ops`."""

from __future__ import annotations

import time
from typing import Any

from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.protocol import ADMIN_ARGS, LOAD_RESERVE

PARAMS = ADMIN_ARGS[LOAD_RESERVE]


def run(state: DaemonState, args: dict[str, Any]) -> dict[str, Any]:
    return state.budget.reserve_load(
        args["model"],
        args["weights"],
        args["kv_min"],
        args["ttl"],
        time.monotonic(),
        args["overhead"],
    )
