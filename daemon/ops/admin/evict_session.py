"""The daemon's side of the admin op ``evict_session``; what it does and takes is declared in
:mod:`vqpool.shared.protocol.admin_ops`."""

from __future__ import annotations

import logging
from typing import Any

from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.errors import NoSessionError
from vqpool.shared.protocol import ADMIN_ARGS, EVICT_SESSION

log = logging.getLogger("vqpoold")

PARAMS = ADMIN_ARGS[EVICT_SESSION]


def run(state: DaemonState, args: dict[str, Any]) -> dict[str, Any]:
    coord = state.coord
    session = coord.sessions.get(args["sid"])
    if session is None:
        raise NoSessionError(f"evict_session: no session {args['sid']}")
    n_owners, n_blocks = state.budget.end_session(session)
    coord.n_sessions_evicted += 1
    log.warning(
        "evicted session %x (pid %d, model %r): freed %d block(s) of %d owner(s)",
        session.sid,
        session.pid,
        session.model,
        n_blocks,
        n_owners,
    )
    return {
        "sid": session.sid,
        "pid": session.pid,
        "owners_freed": n_owners,
        "blocks_freed": n_blocks,
    }
