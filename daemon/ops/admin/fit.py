"""The daemon's side of the admin op ``fit``; what it does and takes is declared in
:mod:`vqpool.shared.protocol.admin_ops`."""

from __future__ import annotations

from typing import Any

from vqpool.daemon.ops.state import DaemonState
from vqpool.daemon.ops.worker.budget import fit_answer, fit_pricing
from vqpool.shared.protocol import ADMIN_ARGS, FIT

PARAMS = ADMIN_ARGS[FIT]


def run(state: DaemonState, args: dict[str, Any]) -> dict[str, Any]:
    coord = state.coord
    budget = state.budget
    model = budget.resolve(args["model"]) or args["model"]
    priced = [
        s for s in coord.sessions if s.model == model and (s.bytes_per_block or s.bytes_per_format)
    ]
    new_weights = 0
    fmt = None
    if priced:
        fmt, bytes_per_block = fit_pricing(priced[0])
    else:
        # Not loaded: priced as the client says (from the model's config), its weights added.
        per_block = args["bytes_per_block"]
        if per_block is None and args["bytes_per_token"] is not None:
            per_block = args["bytes_per_token"] * coord.allocator.config.block_size
        if per_block is None:
            raise ValueError(
                f"no worker of model {model} is connected; its bytes per block are unknown "
                "(give bytes_per_token or bytes_per_block)"
            )
        bytes_per_block = {"all": per_block}
        new_weights = args["weights"] or 0
    answer = fit_answer(
        state, model, bytes_per_block, args["context"], args["concurrency"], new_weights
    )
    return {"model": model, **answer, "format": fmt}
