"""Would CONCURRENCY sequences of CONTEXT tokens of MODEL fit? Verdict ``now``,
``within_reserve``, ``after_others_return`` or ``never``, with the numbers behind it and the
largest concurrency that fits now and ever. Priced with the bytes per block a live worker of
that model declared."""

from __future__ import annotations

from typing import Any

from vqpool.daemon.coordinator import Coordinator
from vqpool.shared.protocol import MAX_ITEMS, Field, check_int, check_str

PARAMS = (
    Field("model", check_str, help="the model name its workers give in hello"),
    Field("context", lambda v, n: check_int(v, n, 1), help="tokens of one sequence"),
    Field(
        "concurrency",
        lambda v, n: check_int(v, n, 1, MAX_ITEMS),
        required=False,
        default=1,
        help="sequences of that size at once",
    ),
)


def run(coord: Coordinator, args: dict[str, Any]) -> dict[str, Any]:
    model = args["model"]
    priced = [s for s in coord.sessions if s.model == model and s.bytes_per_block]
    if not priced:
        raise ValueError(
            f"no worker of model {model} is connected; its bytes per block are unknown"
        )
    return coord.budget.fit(model, priced[0].bytes_per_block, args["context"], args["concurrency"])
