"""The daemon's side of the admin op ``owners``; what it does and takes is declared in
:mod:`vqpool.shared.protocol.admin_ops`."""

from __future__ import annotations

from typing import Any

from vqpool.daemon.core.views import owner_view
from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.errors import NoSessionError
from vqpool.shared.protocol import ADMIN_ARGS, OWNERS

PARAMS = ADMIN_ARGS[OWNERS]


def run(state: DaemonState, args: dict[str, Any]) -> list[dict[str, Any]]:
    coord = state.coord
    if args["sid"] is None:
        sessions = list(coord.sessions)
    else:
        session = coord.sessions.get(args["sid"])
        if session is None:
            raise NoSessionError(f"owners: no session {args['sid']}")
        sessions = [session]
    return [
        owner_view(coord, owner, usage)
        for session in sessions
        for owner, usage in coord.usage_by(session).items()
    ]
