"""The daemon's side of the admin op ``fit``; what it does and takes is declared in
:mod:`vqpool.shared.protocol.admin_ops`."""

from __future__ import annotations

from typing import Any

from vqpool.daemon.ops.state import DaemonState
from vqpool.daemon.ops.worker.budget import fit_answer
from vqpool.shared.protocol import ADMIN_ARGS, FIT

PARAMS = ADMIN_ARGS[FIT]


def run(state: DaemonState, args: dict[str, Any]) -> dict[str, Any]:
    coord = state.coord
    model = state.budget.resolve(args["model"]) or args["model"]
    priced = [s for s in coord.sessions if s.model == model and s.bytes_per_block]
    if not priced:
        raise ValueError(
            f"no worker of model {model} is connected; its bytes per block are unknown"
        )
    answer = fit_answer(
        state, model, priced[0].bytes_per_block, args["context"], args["concurrency"]
    )
    return {"model": model, **answer}
