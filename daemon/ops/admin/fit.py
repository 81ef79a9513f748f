"""Would CONCURRENCY sequences of CONTEXT tokens of MODEL fit? Verdict ``now``,
``within_reserve``, ``after_others_return`` or ``never``, with the numbers behind it and the
largest concurrency that fits now and ever. Priced with the bytes per block a live worker of
that model declared."""

from __future__ import annotations

from typing import Any

from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.protocol import FIT, WORKER_ARGS, Field, check_str

PARAMS = (
    Field("model", check_str, help="the model name its workers give in hello"),
    *WORKER_ARGS[FIT],  # context and concurrency, as the worker op takes them
)


def run(state: DaemonState, args: dict[str, Any]) -> dict[str, Any]:
    coord = state.coord
    model = args["model"]
    priced = [s for s in coord.sessions if s.model == model and s.bytes_per_block]
    if not priced:
        raise ValueError(
            f"no worker of model {model} is connected; its bytes per block are unknown"
        )
    return state.budget.fit(model, priced[0].bytes_per_block, args["context"], args["concurrency"])
