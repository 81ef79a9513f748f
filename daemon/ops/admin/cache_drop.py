"""The daemon's side of the admin op ``cache_drop``; what it does and takes is declared in
:mod:`vqpool.shared.protocol.admin_ops`."""

from __future__ import annotations

import logging
from typing import Any

from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.protocol import ADMIN_ARGS, CACHE_DROP

log = logging.getLogger("vqpoold")

PARAMS = ADMIN_ARGS[CACHE_DROP]


def run(state: DaemonState, args: dict[str, Any]) -> dict[str, Any]:
    coord = state.coord
    model = state.budget.resolve(args["model"]) or args["model"]
    sessions = [s for s in coord.sessions if s.model == model]
    if not sessions:
        raise ValueError(f"cache_drop: no worker of model {model} is connected")
    for session in sessions:
        session.drop_cache = True
        session.drop_disk = session.drop_disk or bool(args["disk"])
    cached = sum(s.prompt_cache["bytes"] for s in sessions if s.prompt_cache)
    log.info("cache_drop: %d worker session(s) of model %r told to drop", len(sessions), model)
    return {
        "model": model,
        "disk": bool(args["disk"]),
        "sessions": len(sessions),
        "cached_bytes": cached,
        "reporting": sum(1 for s in sessions if s.prompt_cache is not None),
    }
