"""Recount the whole pool and cross-check it: free plus in use equals total per stream, no block
free twice or held by two owners, every active owner held by exactly one live session. Returns
ok and the list of problems found (empty when all is well). O(pool size)."""

from __future__ import annotations

from typing import Any

from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.protocol import Field

PARAMS: tuple[Field, ...] = ()


def run(state: DaemonState, args: dict[str, Any]) -> dict[str, Any]:
    coord = state.coord
    problems = coord.audit() + state.budget.recount_problems()
    stats = coord.allocator.stats
    return {
        "ok": not problems,
        "problems": problems,
        "n_blocks": stats.n_blocks,
        "blocks_in_use": stats.blocks_in_use(),
        "sessions": len(coord.sessions),
        "owners": len(coord.allocator.active_owners()),
    }
