"""The daemon's side of the admin op ``stats``; what it does and takes is declared in
:mod:`vqpool.shared.protocol.admin_ops`."""

from __future__ import annotations

import time
from typing import Any

from vqpool.daemon.core.coordinator import Coordinator
from vqpool.daemon.ops.state import DAEMON_VERSION, DaemonState
from vqpool.shared.protocol import (
    ADMIN_ARGS,
    PROTOCOL_VERSION,
    STATS,
    config_to_wire,
    stats_to_wire,
)

PARAMS = ADMIN_ARGS[STATS]


def run(state: DaemonState, args: dict[str, Any]) -> dict[str, Any]:
    coord = state.coord
    allocator = coord.allocator
    stats = allocator.stats
    return {
        "boot_id": coord.boot_id,
        "pid": coord.pid,
        "version": DAEMON_VERSION,
        "protocol": PROTOCOL_VERSION,
        "run_dir": str(coord.run_dir),
        "started": coord.started,
        "uptime_s": coord.uptime(),
        "config": config_to_wire(allocator.config),
        "lease_s": coord.lease,
        "stats": {
            **stats_to_wire(stats),
            "blocks_in_use": stats.blocks_in_use(),
            "fragmentation": stats.fragmentation(),
        },
        "streams": {
            s: {"free": allocator.n_free(s), "total": allocator.n_total(s)}
            for s in allocator.streams
        },
        "sessions": len(coord.sessions),
        "owners": len(allocator.active_owners()),
        "requests": coord.n_requests,
        "bad_requests": coord.n_bad_requests,
        "replies_dropped": coord.n_replies_dropped,
        "sessions_opened": coord.n_sessions_opened,
        "sessions_reaped": coord.n_sessions_reaped,
        "sessions_evicted": coord.n_sessions_evicted,
        "reply_cache": {
            "replies": len(coord.replies),
            "bytes": coord.replies.n_bytes,
            "evicted": coord.replies.n_evicted,
            "bytes_per_session": coord.replies.bytes_per_session,
            "bytes_total": coord.replies.bytes_total,
        },
        "claims": claims_view(coord),
        "budget": state.budget.view(time.monotonic()),
        "connections": {
            "accepted": state.peer_auth.n_accepted if state.peer_auth else 0,
            "refused": state.peer_auth.n_refused if state.peer_auth else 0,
        },
    }


def claims_view(coord: Coordinator) -> dict[str, Any]:
    """What this start took back from the previous daemon's workers (docs/reliability.md)."""
    period = coord.claim_period
    return {
        "grace_s": coord.claim_grace,
        "period": period is not None,
        "active": coord.claiming is not None,
        "period_s": period.duration(time.monotonic()) if period is not None else 0.0,
        "end_reason": period.end_reason if period is not None else "",
        "expected": period.n_expected if period is not None else 0,
        "resynced": len(period.resynced) if period is not None else 0,
        "waiting": len(period.expected) if period is not None else 0,
        "owners_claimed": coord.n_owners_claimed,
        "owners_refused": coord.n_owners_refused,
        "blocks_claimed": coord.n_blocks_claimed,
    }
