"""How the admin commands show sessions and owners (rich, O(blocks held): never on a hot path)."""

from __future__ import annotations

import time
from typing import Any

from vqpool.daemon.coordinator import Coordinator
from vqpool.daemon.sessions import Session
from vqpool.shared.allocator import Block, Owner


def owner_view(coord: Coordinator, owner: Owner, blocks: list[Block]) -> dict[str, Any]:
    """One owner: its session, block counts per stream, tokens stored and fill."""
    session = coord.holder_of(owner)
    per_stream: dict[str, int] = {}
    tokens = 0
    for block in blocks:
        per_stream[block.stream] = per_stream.get(block.stream, 0) + 1
        tokens += block.n_used
    capacity = len(blocks) * coord.allocator.config.block_size
    return {
        "owner": owner,
        "sid": None if session is None else session.sid,
        "pid": None if session is None else session.pid,
        "model": None if session is None else session.model,
        "n_blocks": len(blocks),
        "blocks": per_stream,
        "tokens": tokens,
        "fill": tokens / capacity if capacity else 0.0,
    }


def session_view(coord: Coordinator, session: Session, now: float) -> dict[str, Any]:
    """One session: its worker, what it holds per stream in blocks and bytes, and its lease."""
    per_stream: dict[str, int] = {}
    tokens = 0
    for blocks in coord.held_by(session).values():
        for block in blocks:
            per_stream[block.stream] = per_stream.get(block.stream, 0) + 1
            tokens += block.n_used
    bytes_held = {
        stream: n * session.bytes_per_block.get(stream, 0) for stream, n in per_stream.items()
    }
    silent = now - session.last_heard
    return {
        "sid": session.sid,
        "pid": session.pid,
        "model": session.model,
        "client_version": session.client_version,
        "process": session.process_status(),
        "started": session.started,
        "age_s": time.time() - session.started,
        "last_heard_s": silent,
        "lease": {
            "seconds": coord.lease,
            "remaining_s": max(0.0, coord.lease - silent),
            "state": "ok" if silent <= coord.lease else "expired",
        },
        "n_owners": len(session.owners),
        "n_blocks": sum(per_stream.values()),
        "blocks": per_stream,
        "bytes_per_block": session.bytes_per_block,
        "bytes": bytes_held,
        "bytes_total": sum(bytes_held.values()),
        "tokens": tokens,
        "requests": session.n_requests,
    }
