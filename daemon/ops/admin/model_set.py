"""Set one model's budget settings live: RESERVE (bytes kept for it), LIMIT (bytes it may hold
at most; -1: no limit of its own) and WEIGHT (its share of spare bytes). Fields not given keep
their value. Invalid settings (reserves over the budget, a reserve over the limit, a weight
outside [0.001, 1000]) are refused and nothing changes. Returns the model's view, as in
``model_list``."""

from __future__ import annotations

import math
import time
from typing import Any

from vqpool.daemon.budget.settings import model_settings
from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.protocol import Field, check_int, check_number, check_str

PARAMS = (
    Field("model", check_str, help="the model name its workers give in hello"),
    Field(
        "reserve",
        check_int,
        required=False,
        help="bytes kept for the model",
    ),
    Field(
        "limit",
        check_int,
        required=False,
        help="most bytes the model may hold (-1: no limit of its own)",
    ),
    Field(
        "weight",
        lambda v, n: check_number(v, n, -math.inf, math.inf),
        required=False,
        help="the model's share of spare bytes against the others'",
    ),
)


def run(state: DaemonState, args: dict[str, Any]) -> dict[str, Any]:
    model = args["model"]
    fields: dict[str, Any] = {
        k: args[k] for k in ("reserve", "limit", "weight") if args[k] is not None
    }
    # Values are checked here, not by the schema: a wrong value is INVALID_VALUE (a wrong type
    # is BAD_REQUEST).
    if fields.get("limit") == -1:
        fields["limit"] = None
    elif fields.get("limit", 0) < 0:
        raise ValueError(f"model {model!r}: limit must be >= 0 bytes, or -1 for none")
    budget = state.budget
    settings = model_settings(fields, budget.ledger.settings_of(model), where=f"model {model!r}")
    budget.set_model(model, settings)
    return budget.model_view(model, time.monotonic())
