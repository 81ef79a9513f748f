"""The daemon's side of the admin op ``audit``; what it does and takes is declared in
:mod:`vqpool.shared.protocol.admin_ops`."""

from __future__ import annotations

from typing import Any

from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.protocol import ADMIN_ARGS, AUDIT

PARAMS = ADMIN_ARGS[AUDIT]


def run(state: DaemonState, args: dict[str, Any]) -> dict[str, Any]:
    coord = state.coord
    problems = coord.audit() + state.budget.recount_problems()
    stats = coord.allocator.stats
    return {
        "ok": not problems,
        "problems": problems,
        "breaches": state.budget.breaches(),
        "n_blocks": stats.n_blocks,
        "blocks_in_use": stats.blocks_in_use(),
        "sessions": len(coord.sessions),
        "owners": len(coord.allocator.active_owners()),
    }
