"""Retire free blocks of one stream until at most TARGET_FREE stay free.

Blocks in use are never touched; retired block ids never come back, so workers may drop their
buffers. Returns how many blocks were retired and the stream's free and total counts after.
Refused (retry later) during a restarted daemon's claim period: a free block may be one a
worker is about to claim back.
"""

from __future__ import annotations

from typing import Any

from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.errors import RetryLaterError
from vqpool.shared.protocol import Field, check_int, check_tag

PARAMS = (
    Field("stream", check_tag, help='stream to shrink: "k", "v" (or "kv" in a shared-kv pool)'),
    Field("target_free", check_int, help="free blocks to keep in that stream"),
)


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
