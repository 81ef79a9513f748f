"""The daemon's side of the admin op ``model_set``; what it does and takes is declared in
:mod:`vqpool.shared.protocol.admin_ops`."""

from __future__ import annotations

import time
from typing import Any

from vqpool.daemon.budget.settings import model_settings
from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.protocol import ADMIN_ARGS, MODEL_SET

PARAMS = ADMIN_ARGS[MODEL_SET]


def run(state: DaemonState, args: dict[str, Any]) -> dict[str, Any]:
    budget = state.budget
    model = budget.model_named(args["model"], create=args["create"])
    fields: dict[str, Any] = {
        k: args[k] for k in ("reserve", "limit", "weight") if args[k] is not None
    }
    # Values are checked here, not by the schema: a wrong value is INVALID_VALUE (a wrong type
    # is BAD_REQUEST).
    if fields.get("limit") == -1:
        fields["limit"] = None
    elif fields.get("limit", 0) < 0:
        raise ValueError(f"model {model!r}: limit must be >= 0 bytes, or -1 for none")
    settings = model_settings(fields, budget.ledger.settings_of(model), where=f"model {model!r}")
    budget.set_model(model, settings, fields)
    return budget.model_view(model, time.monotonic())
