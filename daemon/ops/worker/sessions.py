"""Worker ops of the session's life: ``hello`` opens it (or returns it, for a repeated nonce),
``ping`` keeps its lease and reports the worker's load, ``goodbye`` ends it."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from vqpool.daemon.core.sessions import Session, verify_worker_process
from vqpool.daemon.net.peer_process import RequestPeer
from vqpool.daemon.ops.op_table import Args
from vqpool.daemon.ops.state import DAEMON_VERSION, DaemonState
from vqpool.shared.errors import BadRequestError, UnauthorizedError
from vqpool.shared.kv_formats import parse_format
from vqpool.shared.kv_sequence import SequenceQuantization
from vqpool.shared.protocol import PROTOCOL_VERSION, config_to_wire

log = logging.getLogger("vqpoold")

HEARTBEATS_PER_LEASE = 4
"""The client pings every min(lease, claim grace) / 4: three lost heartbeats in a row still keep
the lease, and an idle worker notices a restart well inside the claim period."""


def hello(state: DaemonState, peer: RequestPeer, args: Args, now: float) -> Any:
    """``hello``: served before any session check (it opens the session), so it takes the
    connection ``peer`` instead of a session: the pid it declares must be the connected one."""
    coord = state.coord
    session = coord.sessions.by_nonce(args["nonce"])
    if session is None:
        process = verify_worker_process(args["pid"])
        connected = peer.pid()
        if connected is not None and connected != process.pid:
            raise UnauthorizedError(
                f"hello: pid {process.pid} is not the process connected ({connected}); "
                "a session follows the process that opens it"
            )
        streams = coord.allocator.streams
        bytes_per_block = per_stream(args["bytes_per_block"], streams)
        state.budget.check_hello(bytes_per_block, streams)
        bytes_per_format = {
            tag: per_stream(costs, streams) for tag, costs in args["bytes_per_format"].items()
        }
        for tag, costs in bytes_per_format.items():
            state.budget.check_hello(costs, streams, f"bytes_per_format[{tag}]")
        quantization = None
        if any(parse_format(tag) is not None for tag in bytes_per_format):
            try:
                quantization = SequenceQuantization(
                    args["quantized_kv_start"], args["first_pass_slots"]
                )
            except ValueError as exc:
                raise BadRequestError(f"hello: {exc}") from None
        session = coord.sessions.open(
            process,
            args["model"],
            bytes_per_block,
            args["client_version"],
            args["nonce"],
            now,
            bytes_per_format,
            quantization,
        )
        coord.session_opened(session, args["resumes"])
        log.info(
            "session %x opened: pid %d, model %r, client %s%s",
            session.sid,
            session.pid,
            session.model,
            session.client_version or "?",
            "" if session.resumes is None else f", resumes session {session.resumes:x}",
        )
    elif session.pid != args["pid"]:
        raise BadRequestError("hello: this nonce belongs to another process's session")
    if args["weights"] is not None:  # a repeated hello charges again: the same bytes
        session.overhead = args["overhead"] or 0
        state.budget.charge_weights(session, args["weights"])
    session.last_heard = now
    lease = coord.lease
    return {
        "sid": session.sid,
        "boot": coord.boot_id,
        "protocol": PROTOCOL_VERSION,
        "config": config_to_wire(coord.allocator.config),
        "streams": list(coord.allocator.streams),
        "lease": lease,
        "heartbeat": min(lease, coord.claim_grace or lease) / HEARTBEATS_PER_LEASE,
        "claim_grace": coord.claim_grace,
        "daemon_pid": coord.pid,
        "daemon_version": DAEMON_VERSION,
        "started": coord.started,
        "time": time.time(),
    }


def per_stream(costs: int | dict[str, int], streams: Sequence[str]) -> dict[str, int]:
    """A hello's bytes per block as a map stream -> bytes (one int: the same for every stream)."""
    return dict.fromkeys(streams, costs) if isinstance(costs, int) else dict(costs)


def goodbye(
    state: DaemonState, session: Session, args: Args, rid: int, now: float
) -> dict[str, Any]:
    n_owners, n_blocks = state.budget.end_session(session)
    return {"ended": True, "owners_released": n_owners, "blocks_freed": n_blocks}


def ping(
    state: DaemonState, session: Session, args: Args, rid: int, now: float
) -> dict[str, Any] | None:
    # The lease is refreshed by any request; a ping may also carry the worker's load.
    if args["running"] is not None:
        session.running = args["running"]
    if args["queued"] is not None:
        session.queued = args["queued"]
    state.budget.reclaim.note_load(session, args["preemptions"])
    cache = args["prompt_cache"]
    if cache is not None:
        before = session.prompt_cache
        if before is None or cache["lookups"] != before["lookups"]:
            session.cache_used_at = now
        session.prompt_cache = cache
    if args["memory"] is not None:
        state.budget.note_memory(session, args["memory"], now)
    return cache_advice(state, session, now)


def cache_advice(state: DaemonState, session: Session, now: float) -> dict[str, Any] | None:
    """What the answer to a load report asks of the worker's prompt cache (None: nothing):
    ``drop_cache`` once after ``cache_drop``; else ``release_bytes`` from a worker that reports
    cached bytes, when giving them back would let allocations of other sessions that wait for
    memory be granted (:func:`bytes_cache_would_serve`) or that were refused for lack of ids
    (:func:`bytes_freeing_ids`), or a load asked for them (``load_reserve``)."""
    if session.drop_cache:
        session.drop_cache = False
        if session.drop_disk:
            session.drop_disk = False
            return {"drop_cache": True, "drop_disk": True}
        return {"drop_cache": True}
    if not session.prompt_cache or not session.prompt_cache["bytes"]:
        session.release_cache = 0
        return None
    asked, session.release_cache = session.release_cache, 0
    # NOTE: the byte ledger parks byte waits only: an allocation refused because the pool's ids
    # ran out (a fixed --n-blocks under a budget that does not bind) waits at its worker, so
    # without the second term a prompt cache elsewhere would keep those ids forever.
    wanted = max(
        asked, bytes_cache_would_serve(state, session), bytes_freeing_ids(state, session, now)
    )
    return {"release_bytes": wanted} if wanted else None


def bytes_freeing_ids(state: DaemonState, session: Session, now: float) -> int:
    """Bytes the cache of ``session`` would give back to free as many blocks as allocations
    refused for lack of ids lately still lack (:meth:`Coordinator.ids_short`); 0 if none.

    A cached entry holds as many blocks in each stream (its keys and its values), so freeing n
    blocks of any one stream gives back n blocks' bytes of every stream."""
    short = state.coord.ids_short(now)
    if not short:
        return 0
    cost = session.bytes_per_block
    return max(short.values()) * sum(cost.get(s, 0) for s in state.coord.allocator.streams)


def bytes_cache_would_serve(state: DaemonState, session: Session) -> int:
    """Bytes the cache of ``session`` would have to give back for the allocations waiting at
    the daemon to be granted; 0 when its bytes cannot help.

    Per waiting model: its waiting allocations, in arrival order, up to the first its own limit
    cannot take (bytes another model frees do not raise a model's limit; the session's own
    model's bytes do, so all of its model's count), less what its limit and the budget would
    grant it now. And in all, at least what they want beyond the budget's free bytes. The
    session's own waiting allocations count: cached memory goes before a request waits, and
    for a model above its limit (lowered live) its own cache is the only memory that serves it.
    """
    parked = state.budget.parking.parked
    if not parked:
        return 0
    ledger = state.budget.ledger
    waiting: dict[str, list[int]] = {}
    for request in parked.values():
        if ledger.is_waiting((request.session.sid, request.rid)):
            waiting.setdefault(request.session.model, []).append(request.n_bytes)
    lacking = wanted = 0
    for model, sizes in waiting.items():
        fit = ledger.fit(model, 1)
        room = fit.limit - fit.held  # what its limit lets it take (< 0: held above it)
        demand = 0
        for n_bytes in sizes:
            if model != session.model and demand + n_bytes > room:
                break
            demand += n_bytes
        if demand:
            wanted += demand
            lacking += max(0, demand - min(room, fit.available_now))
    return max(lacking, wanted - ledger.free)
