"""A client for vqpoold's admin socket (used by vqpoolctl, tests and benchmarks)."""

from __future__ import annotations

import itertools
import os
import secrets
from typing import Any

import zmq
from vqpool.shared.config import ADMIN_SOCKET_NAME, endpoint, resolve_run_dir
from vqpool.shared.errors import DaemonUnavailableError, error_from_wire
from vqpool.shared.protocol import encode_request
from vqpool.shared.transport import LazyPirateConnection

DEFAULT_ADMIN_TIMEOUT = 5.0


class AdminClient:
    """Calls admin ops (:data:`~vqpool.shared.protocol.ADMIN_OP_SPECS` declares them) and
    returns their results.

    Errors come back as the exception classes of :mod:`vqpool.shared.errors`. Retries after a
    lost reply are safe in effect: ``shrink`` to a target is idempotent, and a repeated
    ``evict_session`` finds nothing left to evict (it raises NoSessionError).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None = None,
        *,
        timeout: float = DEFAULT_ADMIN_TIMEOUT,
    ) -> None:
        self.run_dir = resolve_run_dir(run_dir)
        self.timeout = timeout
        self._context: zmq.Context[Any] = zmq.Context()
        self._connection = LazyPirateConnection(
            self._context, endpoint(self.run_dir, ADMIN_SOCKET_NAME)
        )
        # Random start: request ids of two admin clients never look alike in the daemon's log.
        self._ids = itertools.count(secrets.randbits(31))

    def call(self, op: str, **args: Any) -> Any:
        """Run admin op ``op`` with keyword ``args`` and return its result."""
        rid = next(self._ids)
        try:
            reply = self._connection.request(encode_request(rid, op, args), rid, self.timeout, op)
        except DaemonUnavailableError as exc:
            raise DaemonUnavailableError(
                f"{exc}. Is vqpoold running with --run-dir {self.run_dir}? Check that "
                f"{self.run_dir / ADMIN_SOCKET_NAME} exists and the daemon's log."
            ) from None
        if reply["ok"]:
            return reply.get("result")
        error = reply["error"]
        raise error_from_wire(error["code"], error["message"])

    def close(self) -> None:
        """Close the socket and the ZeroMQ context."""
        self._connection.close()
        self._context.term()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
