"""Force-end a worker session: free every block of every owner it holds and release the owner
ids. The worker's next call fails with a no-session error. Use for a hung worker that is still
running (the daemon never reaps a running process on its own)."""

from __future__ import annotations

import logging
from typing import Any

from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.errors import NoSessionError
from vqpool.shared.protocol import Field, check_int

log = logging.getLogger("vqpoold")

PARAMS = (Field("sid", check_int, help="session id, as `sessions` lists it"),)


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
