"""The worker socket's request handler: envelope, session, reply cache, then the op.

Order of checks for one request (each refusal changes nothing):

1. msgpack within limits, envelope fields, protocol version;
2. the op is a worker op (admin ops here are UNAUTHORIZED);
3. ``hello`` opens (or, for a repeated nonce, returns) a session; any other op needs the boot id
   of this daemon lifetime (else DAEMON_RESTARTED) and a live session id (else NO_SESSION);
4. a mutating op whose request id was seen gets the cached reply, not a second application;
5. the op's arguments against its schema, then the op.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from vqpool.daemon.budget.parking import ParkedRequest
from vqpool.daemon.budget.reclaim_service import ParkedPoll
from vqpool.daemon.core.error_reply import error_reply
from vqpool.daemon.core.sessions import Session, verify_worker_process
from vqpool.daemon.net.peer_log import PeerLogLimiter
from vqpool.daemon.net.peer_process import RequestPeer
from vqpool.daemon.ops.state import DAEMON_VERSION, DaemonState
from vqpool.shared.errors import (
    BadRequestError,
    DaemonRestartedError,
    ErrorCode,
    NoSessionError,
    RetryLaterError,
    UnauthorizedError,
    UnknownOpError,
    VqpoolError,
    error_code_for,
)
from vqpool.shared.protocol import (
    ADMIN_OPS,
    ALLOCATE,
    ALLOCATE_MANY,
    FIT,
    GOODBYE,
    HELLO,
    MUTATING_OPS,
    PROTOCOL_VERSION,
    RECLAIM_DONE,
    RECLAIM_POLL,
    REGISTER_OWNER,
    WORKER_ARGS,
    WORKER_OPS,
    block_rows,
    config_to_wire,
    decode_request,
    encode_result,
    parse_args,
    parse_envelope,
    request_id_of,
    session_label,
    stats_to_wire,
)

log = logging.getLogger("vqpoold")

HEARTBEATS_PER_LEASE = 4
"""The client pings every min(lease, claim grace) / 4: three lost heartbeats in a row still keep
the lease, and an idle worker notices a restart well inside the claim period."""

CLAIM_PERIOD_REFUSED = frozenset({ALLOCATE, ALLOCATE_MANY, REGISTER_OWNER})
"""Ops refused with RETRY_LATER while a restarted daemon takes claims: each could hand out a
block or owner id that a worker is about to claim back."""

BUDGETED_OPS = frozenset({ALLOCATE, ALLOCATE_MANY})
"""Ops that ask the memory budget first, and may be parked until it grants them
(``daemon/budget/parking.py``)."""

Handler = Callable[[DaemonState, Session, dict[str, Any]], Any]


def _goodbye(state: DaemonState, session: Session, args: dict[str, Any]) -> Any:
    n_owners, n_blocks = state.budget.end_session(session)
    return {"ended": True, "owners_released": n_owners, "blocks_freed": n_blocks}


def _ping(state: DaemonState, session: Session, args: dict[str, Any]) -> dict[str, Any] | None:
    # The lease is refreshed by any request; a ping may also carry the worker's load.
    if args["running"] is not None:
        session.running = args["running"]
    if args["queued"] is not None:
        session.queued = args["queued"]
    state.budget.reclaim.note_load(session, args["preemptions"])
    if args["prompt_cache"] is not None:
        session.prompt_cache = args["prompt_cache"]
    return cache_advice(state, session)


def cache_advice(state: DaemonState, session: Session) -> dict[str, Any] | None:
    """What the answer to a load report asks of the worker's prompt cache (None: nothing):
    ``drop_cache`` once after ``cache_drop``; else, while allocations of other sessions wait
    for memory, ``release_bytes`` (what they wait for) from a worker that reports cached bytes.
    """
    if session.drop_cache:
        session.drop_cache = False
        return {"drop_cache": True}
    if not session.prompt_cache or not session.prompt_cache["bytes"]:
        return None
    waiting = state.budget.parking.bytes_waiting_for_others(session)
    return {"release_bytes": waiting} if waiting else None


HANDLERS: dict[str, Handler] = {
    GOODBYE: _goodbye,
    "ping": _ping,
    "free": lambda state, session, a: state.budget.holdings.free(session, a["block_ids"]),
    "free_all": lambda state, session, a: state.budget.holdings.free_all(session, a["owner"]),
    "register_owner": lambda state, session, a: state.coord.register_owner(session, a["owner"]),
    "release_owner": lambda state, session, a: state.coord.release_owner(session, a["owner"]),
    "blocks_for": lambda state, session, a: block_rows(state.coord.blocks_for(session, a["owner"])),
    "n_free": lambda state, session, a: state.coord.allocator.n_free(a["stream"]),
    "mark_used": lambda state, session, a: state.coord.mark_used(session, a["updates"]),
    "stats": lambda state, session, a: stats_to_wire(state.coord.allocator.stats),
    "history": lambda state, session, a: [stats_to_wire(s) for s in state.coord.allocator.history],
    "metrics": lambda state, session, a: state.coord.allocator.stats.to_prometheus(),
    "claim": lambda state, session, a: state.budget.holdings.claim(session, a["owners"], a["done"]),
    FIT: lambda state, session, a: state.budget.fit(
        session.model, session.bytes_per_block, a["context"], a["concurrency"]
    ),
    RECLAIM_DONE: lambda state, session, a: state.budget.reclaim.done(
        session, a["ask"], a["freed"], time.monotonic()
    ),
}
assert HANDLERS.keys() == WORKER_OPS - {HELLO, RECLAIM_POLL} - BUDGETED_OPS


class WorkerRequestHandler:
    """Turns one worker request frame into its reply frame.

    ``last_op`` and ``last_code`` tell the op and outcome (0 or the error code) of the request
    handled last, for the metrics (``daemon/server/metrics.py``); a cached reply counts as 0.
    ``peer`` is the connection of the request being handled (set by the server loop): hello
    checks the pid it declares against the connected process's.
    """

    def __init__(self, state: DaemonState) -> None:
        self._state = state
        self._coord = state.coord
        self._budget = state.budget
        self.peer = RequestPeer()
        self._bad_log = PeerLogLimiter()
        self.last_op = ""
        self.last_code = 0
        self._stale_boot_logged = False

    def handle(self, payload: bytes, peer: bytes, now: float) -> bytes | ParkedRequest | ParkedPoll:
        """The reply to ``payload`` from connection ``peer``, at monotonic time ``now``; or,
        for an allocation that waits for memory, its :class:`ParkedRequest`, and for a
        ``reclaim_poll`` with no ask yet its :class:`ParkedPoll` (no reply now: the server loop
        keeps the envelope in it and sends the reply once there is one)."""
        coord = self._coord
        coord.n_requests += 1
        boot = coord.boot_id
        message: Any = None
        self.last_op = ""
        self.last_code = 0
        try:
            message = decode_request(payload)
            request = parse_envelope(message)
            op = self.last_op = request.op
            if op not in WORKER_OPS:
                if op in ADMIN_OPS:
                    raise UnauthorizedError(f"{op!r} is an admin op: use the admin socket")
                raise UnknownOpError(f"unknown op {op!r}")
            if op == HELLO:
                return self._hello(request.id, request.args, now)
            if request.boot != boot:
                if request.boot is None:
                    raise BadRequestError(f"{op}: boot id missing (send the one hello returned)")
                # Expected once per worker after a restart (it re-syncs on this reply): not a
                # bad request.
                self._note_stale_boot(request.boot, peer)
                self.last_code = ErrorCode.DAEMON_RESTARTED
                return error_reply(
                    request.id,
                    boot,
                    DaemonRestartedError(
                        f"{op}: this request is for daemon lifetime {request.boot}, but vqpoold "
                        f"restarted (now {boot}); blocks of the old lifetime are gone: not applied"
                    ),
                )
            session = coord.sessions.get(request.sid)
            if session is None:
                sid_text = "given" if request.sid is None else session_label(request.sid)
                if op == GOODBYE:  # a retried goodbye whose first reply was lost
                    return encode_result(request.id, boot, {"ended": False})
                raise NoSessionError(
                    f"{op}: no session {sid_text} (say hello first; sessions end on goodbye, "
                    "eviction, or when the worker process is gone)"
                )
        except (VqpoolError, ValueError) as exc:
            coord.n_bad_requests += 1
            self._bad_log.note(peer, "worker", str(exc))
            self.last_code = error_code_for(exc)
            return error_reply(request_id_of(message), boot, exc)
        session.last_heard = now
        session.n_requests += 1
        rid = request.id
        mutating = op in MUTATING_OPS
        try:
            if mutating:
                if not session.on_roll:  # a restart must wait for it once it may hold blocks
                    coord.write_roll()
                if coord.claiming is not None and op in CLAIM_PERIOD_REFUSED:
                    coord.claiming.refuse_allocation(op, now)
                    coord.check_claim_period(now)  # its time ran out just now
                parked = self._budget.parking.parked
                if parked and (session.sid, rid) in parked:  # a resend: answer the newest one
                    return parked[session.sid, rid]
                cached = coord.replies.lookup(session.sid, rid)
                if cached is not None:
                    return cached
            args = parse_args(op, request.args, WORKER_ARGS[op])
            if op in BUDGETED_OPS:
                result = self._budget.allocate(session, op, args, rid, now)
                if type(result) is ParkedRequest:
                    return result
            elif op == RECLAIM_POLL:
                return self._budget.reclaim.poll(session, rid, args["wait"], now)
            else:
                result = HANDLERS[op](self._state, session, args)
            reply = encode_result(rid, boot, result)
        except RetryLaterError as exc:
            # Not cached: the same request must be served once the claim period is over.
            self.last_code = exc.code
            return error_reply(rid, boot, exc)
        except BadRequestError as exc:
            coord.n_bad_requests += 1
            self._bad_log.note(peer, "worker", str(exc))
            self.last_code = exc.code
            reply = error_reply(rid, boot, exc)
        except Exception as exc:
            self.last_code = error_code_for(exc)
            reply = error_reply(rid, boot, exc)
        if mutating:
            coord.replies.remember(session.sid, rid, reply)
        return reply

    def _note_stale_boot(self, stale: object, peer: bytes) -> None:
        """Log the first request of a previous daemon lifetime at INFO, later ones at DEBUG."""
        if self._stale_boot_logged:
            log.debug(
                "request of previous lifetime %s from peer %s: told to re-sync", stale, peer.hex()
            )
            return
        self._stale_boot_logged = True
        log.info(
            "a worker of a previous lifetime (%s) is back: told it to re-sync (later ones are "
            "logged at DEBUG)",
            stale,
        )

    def _hello(self, rid: int, raw_args: Any, now: float) -> bytes:
        coord = self._coord
        args = parse_args(HELLO, raw_args, WORKER_ARGS[HELLO])
        session = coord.sessions.by_nonce(args["nonce"])
        if session is None:
            process = verify_worker_process(args["pid"])
            connected = self.peer.pid()
            if connected is not None and connected != process.pid:
                raise UnauthorizedError(
                    f"hello: pid {process.pid} is not the process connected ({connected}); "
                    "a session follows the process that opens it"
                )
            bytes_per_block = args["bytes_per_block"]
            if type(bytes_per_block) is int:
                bytes_per_block = dict.fromkeys(coord.allocator.streams, bytes_per_block)
            self._budget.check_hello(bytes_per_block, coord.allocator.streams)
            session = coord.sessions.open(
                process,
                args["model"],
                bytes_per_block,
                args["client_version"],
                args["nonce"],
                now,
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
        session.last_heard = now
        lease = coord.lease
        return encode_result(
            rid,
            coord.boot_id,
            {
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
            },
        )
