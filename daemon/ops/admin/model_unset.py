"""The daemon's side of the admin op ``model_unset``; what it does and takes is declared in
:mod:`vqpool.shared.protocol.admin_ops`."""

from __future__ import annotations

import time
from typing import Any

from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.protocol import ADMIN_ARGS, MODEL_UNSET

PARAMS = ADMIN_ARGS[MODEL_UNSET]


def run(state: DaemonState, args: dict[str, Any]) -> dict[str, Any]:
    budget = state.budget
    model = budget.model_named(args["model"])
    budget.unset_model(model)
    views = budget.model_views(time.monotonic())
    return {"model": model, "view": next((v for v in views if v["model"] == model), None)}
