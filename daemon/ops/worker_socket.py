"""The worker socket's request handler: envelope, session, reply cache, then the op.

Order of checks for one request (each refusal changes nothing):

1. msgpack within limits, envelope fields, protocol version;
2. the op is a worker op (admin ops here are UNAUTHORIZED);
3. ``hello`` opens (or, for a repeated nonce, returns) a session; any other op needs the boot id
   of this daemon lifetime (else DAEMON_RESTARTED) and a live session id (else NO_SESSION);
4. a mutating op whose request id was seen gets the cached reply, not a second application;
5. the op's arguments against its parameters, then its handler (both from
   :data:`~vqpool.daemon.ops.worker.WORKER_TABLE`, as the admin socket's from its table).
"""

from __future__ import annotations

import logging
from typing import Any

from vqpool.daemon.budget.parking import Parked
from vqpool.daemon.core.error_reply import error_reply
from vqpool.daemon.net.peer_log import PeerLogLimiter
from vqpool.daemon.net.peer_process import RequestPeer
from vqpool.daemon.ops.state import DaemonState
from vqpool.daemon.ops.worker import WORKER_TABLE, sessions
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
    GOODBYE,
    HELLO,
    MUTATING_OPS,
    REGISTER_OWNER,
    WORKER_ARGS,
    WORKER_OPS,
    SocketCodec,
    parse_args,
    parse_envelope,
    request_id_of,
    session_label,
)

log = logging.getLogger("vqpoold")

CLAIM_PERIOD_REFUSED = frozenset({ALLOCATE, ALLOCATE_MANY, REGISTER_OWNER})
"""Ops refused with RETRY_LATER while a restarted daemon takes claims: each could hand out a
block or owner id that a worker is about to claim back."""


class WorkerRequestHandler:
    """Turns one worker request frame into its reply frame.

    ``last_op`` and ``last_code`` tell the op and outcome (0 or the error code) of the request
    handled last, for the metrics (``daemon/server/metrics.py``); a cached reply counts as 0.
    ``peer`` is the connection of the request being handled (set by the server loop): hello
    checks the pid it declares against the connected process's.

    The reply of a mutating request goes into the reply cache in :meth:`settle`, which the
    server loop calls right after sending it (nothing runs in between), so that the client does
    not wait for the cache's bookkeeping; the next request's handling settles first if a caller
    did not.
    """

    def __init__(self, state: DaemonState) -> None:
        self._state = state
        self._coord = state.coord
        self._parked = state.budget.parking.parked
        self.peer = RequestPeer()
        self._bad_log = PeerLogLimiter()
        self.last_op = ""
        self.last_code = 0
        self._stale_boot_logged = False
        self._codec = SocketCodec(self._coord.boot_id)
        self._unsettled: tuple[int, int, bytes] | None = None  # (sid, rid, reply) to keep

    def handle(self, payload: bytes, peer: bytes, now: float) -> bytes | Parked:
        """The reply to ``payload`` from connection ``peer``, at monotonic time ``now``; or,
        for an allocation that waits for memory or a ``reclaim_poll`` with no ask yet, its
        :class:`~vqpool.daemon.budget.parking.Parked` request (no reply now: the server loop
        keeps the envelope in it and sends the reply once there is one)."""
        if self._unsettled is not None:
            self.settle()
        coord = self._coord
        coord.n_requests += 1
        boot = coord.boot_id
        message: Any = None
        encode_result = self._codec.result
        self.last_op = ""
        self.last_code = 0
        try:
            message = self._codec.decode(payload)
            request = parse_envelope(message)
            op = self.last_op = request.op
            if op not in WORKER_OPS:
                if op in ADMIN_OPS:
                    raise UnauthorizedError(f"{op!r} is an admin op: use the admin socket")
                raise UnknownOpError(f"unknown op {op!r}")
            if op == HELLO:
                args = parse_args(HELLO, request.args, WORKER_ARGS[HELLO])
                return encode_result(
                    request.id, boot, sessions.hello(self._state, self.peer, args, now)
                )
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
                parked = self._parked
                if parked and (session.sid, rid) in parked:  # a resend: answer the newest one
                    return parked[session.sid, rid]
                cached = coord.replies.lookup(session.sid, rid)
                if cached is not None:
                    return cached
            entry = WORKER_TABLE[op]
            args = parse_args(op, request.args, entry.params)
            result = entry.handler(self._state, session, args, rid, now)
            if isinstance(result, Parked):
                return result
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
            self._unsettled = (session.sid, rid, reply)
        return reply

    def settle(self) -> None:
        """Keep the reply of the request handled last in the reply cache, if it is a mutating
        request's (see the class)."""
        unsettled = self._unsettled
        if unsettled is not None:
            self._unsettled = None
            self._coord.replies.remember(*unsettled)

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
