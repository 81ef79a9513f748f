"""How the admin commands show sessions and owners (O(allocations held): never on a hot path)."""

from __future__ import annotations

import time
from typing import Any

from vqpool.daemon.core.coordinator import Coordinator
from vqpool.daemon.core.sessions import Session
from vqpool.shared.allocator import Owner


def sequence_tokens(usage: dict[str, tuple[int, int]]) -> int:
    """Token slots one owner's sequence has marked used: the K and V streams hold the same
    tokens, so the larger of the two counts, not their sum."""
    return max((n_tokens for _, n_tokens in usage.values()), default=0)


def owner_view(
    coord: Coordinator, owner: Owner, usage: dict[str, tuple[int, int]]
) -> dict[str, Any]:
    """One owner: its session, block counts per stream, token slots marked used per sequence,
    and fill (those slots over the slots of the blocks that hold the sequence)."""
    session = coord.holder_of(owner)
    per_stream = {stream: n_blocks for stream, (n_blocks, _) in usage.items()}
    n_blocks = sum(per_stream.values())
    tokens = sequence_tokens(usage)
    capacity = max(per_stream.values(), default=0) * coord.allocator.config.block_size
    return {
        "owner": owner,
        "sid": None if session is None else session.sid,
        "pid": None if session is None else session.pid,
        "model": None if session is None else session.model,
        "n_blocks": n_blocks,
        "blocks": per_stream,
        "tokens": tokens,
        "fill": tokens / capacity if capacity else 0.0,
    }


def priced_holdings(
    coord: Coordinator, session: Session
) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """The bytes ``session``'s blocks hold per stream, and per block format
    ``{format: {"blocks": n, "bytes": b}}`` (formats in name order): each block at its format's
    bytes, as the budget charges it."""
    per_stream: dict[str, int] = {}
    formats: dict[str, dict[str, int]] = {}
    format_usage = coord.allocator.format_usage
    for owner in session.owners:
        for (stream, fmt), n in format_usage(owner).items():
            if n:
                n_bytes = n * session.block_bytes(stream, fmt)
                per_stream[stream] = per_stream.get(stream, 0) + n_bytes
                row = formats.setdefault(fmt, {"blocks": 0, "bytes": 0})
                row["blocks"] += n
                row["bytes"] += n_bytes
    return per_stream, dict(sorted(formats.items()))


def session_view(coord: Coordinator, session: Session, now: float) -> dict[str, Any]:
    """One session: its worker, what it holds per stream and per format in blocks and bytes
    (a block at its format's bytes), and its lease."""
    per_stream: dict[str, int] = {}
    tokens = 0
    for usage in coord.usage_by(session).values():
        for stream, (n_blocks, _) in usage.items():
            per_stream[stream] = per_stream.get(stream, 0) + n_blocks
        tokens += sequence_tokens(usage)
    bytes_by_stream, formats = priced_holdings(coord, session)
    bytes_held = {stream: bytes_by_stream.get(stream, 0) for stream in per_stream}
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
        "bytes_per_format": session.bytes_per_format,
        "bytes": bytes_held,
        "bytes_total": sum(bytes_held.values()),
        "formats": formats,
        "tokens": tokens,
        "requests": session.n_requests,
        "running": session.running,
        "queued": session.queued,
        "prompt_cache": session.prompt_cache,
        "memory": session.memory,
    }
