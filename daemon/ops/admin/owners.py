"""List active owners: session, pid and model holding each, blocks per stream, token slots of
its sequence marked used (K and V counted once) and fill (those slots / the slots of the blocks
holding the sequence). With SID, only that session's owners."""

from __future__ import annotations

from typing import Any

from vqpool.daemon.core.views import owner_view
from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.errors import NoSessionError
from vqpool.shared.protocol import Field, check_int

PARAMS = (Field("sid", check_int, required=False, help="only this session's owners"),)


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
