"""Make the workers of MODEL drop their prompt cache: every cached entry's blocks go back to the
pool. The daemon never waits for a worker: each is told in the answer to its next load report
(its heartbeat, within a quarter of the lease), so the bytes come back within that time; the
answer says how many sessions were told and the cached bytes they last reported."""

from __future__ import annotations

import logging
from typing import Any

from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.protocol import Field, check_str

log = logging.getLogger("vqpoold")

PARAMS = (Field("model", check_str, help="the model name its workers give in hello"),)


def run(state: DaemonState, args: dict[str, Any]) -> dict[str, Any]:
    coord = state.coord
    model = args["model"]
    sessions = [s for s in coord.sessions if s.model == model]
    if not sessions:
        raise ValueError(f"cache_drop: no worker of model {model} is connected")
    for session in sessions:
        session.drop_cache = True
    cached = sum(s.prompt_cache["bytes"] for s in sessions if s.prompt_cache)
    log.info("cache_drop: %d worker session(s) of model %r told to drop", len(sessions), model)
    return {
        "model": model,
        "sessions": len(sessions),
        "cached_bytes": cached,
        "reporting": sum(1 for s in sessions if s.prompt_cache is not None),
    }
