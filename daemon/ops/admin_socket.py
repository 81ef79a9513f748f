"""The admin socket's request handler: the dispatcher over the admin op table.

Admin requests use the worker envelope without ``sid`` or ``boot``. Only admin ops are served
here; a worker op sent to the admin socket is UNAUTHORIZED, as an admin op sent to the worker
socket is.
"""

from __future__ import annotations

from typing import Any

from vqpool.daemon.core.error_reply import error_reply
from vqpool.daemon.net.peer_log import PeerLogLimiter
from vqpool.daemon.ops.admin import ADMIN_TABLE
from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.errors import (
    UnauthorizedError,
    UnknownOpError,
    VqpoolError,
    error_code_for,
)
from vqpool.shared.protocol import (
    WORKER_OPS,
    decode_request,
    encode_result,
    parse_args,
    parse_envelope,
    request_id_of,
)


class AdminRequestHandler:
    """Turns one admin request frame into its reply frame (``last_op``/``last_code``: the op and
    outcome of the request handled last, for the metrics)."""

    def __init__(self, state: DaemonState) -> None:
        self._state = state
        self._bad_log = PeerLogLimiter()
        self.last_op = ""
        self.last_code = 0

    def handle(self, payload: bytes, peer: bytes, now: float) -> bytes:
        """The reply to ``payload`` from admin connection ``peer``."""
        coord = self._state.coord
        message: Any = None
        self.last_op = ""
        self.last_code = 0
        try:
            message = decode_request(payload)
            request = parse_envelope(message)
            self.last_op = request.op
            op = ADMIN_TABLE.get(request.op)
            if op is None:
                if request.op in WORKER_OPS:
                    raise UnauthorizedError(f"{request.op!r} is a worker op: use the worker socket")
                raise UnknownOpError(
                    f"unknown admin op {request.op!r} (known: {sorted(ADMIN_TABLE)})"
                )
            args = parse_args(request.op, request.args, op.params)
        except (VqpoolError, ValueError) as exc:
            coord.n_bad_requests += 1
            self._bad_log.note(peer, "admin", str(exc))
            self.last_code = error_code_for(exc)
            return error_reply(request_id_of(message), coord.boot_id, exc)
        try:
            return encode_result(request.id, coord.boot_id, op.handler(self._state, args))
        except Exception as exc:
            self.last_code = error_code_for(exc)
            return error_reply(request.id, coord.boot_id, exc)
