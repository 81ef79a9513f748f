"""The daemon's side of the admin op ``shrink``; what it does and takes is declared in
:mod:`vqpool.shared.protocol.admin_ops`."""

from __future__ import annotations

from typing import Any

from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.errors import RetryLaterError
from vqpool.shared.protocol import ADMIN_ARGS, SHRINK

PARAMS = ADMIN_ARGS[SHRINK]


def run(state: DaemonState, args: dict[str, Any]) -> dict[str, Any]:
    coord = state.coord
    if coord.claiming is not None:
        raise RetryLaterError(
            "shrink: vqpoold restarted and is taking back blocks its workers still hold; "
            "shrinking now could retire one of them: retry when the claim period is over"
        )
    allocator = coord.allocator
    retired = allocator.shrink(args["stream"], args["target_free"])
    stream = args["stream"] if allocator.config.separate_kv else "kv"
    return {
        "stream": stream,
        "retired": retired,
        "n_free": allocator.n_free(stream),
        "n_total": allocator.n_total(stream),
    }
