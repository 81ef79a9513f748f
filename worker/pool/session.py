"""The client's line to vqpoold: its sockets and request ids, the session its requests are sent
in, and what the daemon's hello told about it.

Every part of a :class:`~vqpool.worker.pool.client.PoolClient` (its calls, its re-sync, its
heartbeat, its reclaim listener) sends through one :class:`DaemonSession`:

* the caller's calls go over one Lazy Pirate connection (a silent attempt is resent with the
  same request id on a fresh socket, so a lost reply costs a resend, never a doubled
  allocation), serialized on :attr:`DaemonSession.lock`;
* requests the daemon may park (waiting allocations, reclaim polls) go on sockets of their
  own (:meth:`DaemonSession.wait_for`), that a closing client cuts short;
* request ids come from one counter shared by all of them;
* :attr:`DaemonSession.current` is the (session id, boot id) pair, replaced as one value, so
  a thread reading it without the lock never sees a half-updated pair.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import secrets
import threading
from collections.abc import Callable, Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import zmq
from vqpool.shared.allocator import PoolConfig
from vqpool.shared.config import WORKER_SOCKET_NAME, endpoint
from vqpool.shared.errors import DaemonUnavailableError, ErrorCode, error_from_wire
from vqpool.shared.kv_sequence import SequenceQuantization
from vqpool.shared.protocol import config_from_wire, encode_request
from vqpool.shared.transport import LazyPirateConnection
from vqpool.worker.pool.waiting_call import request_waiting

try:
    CLIENT_VERSION = version("vqpool")
except PackageNotFoundError:  # a source tree that is not installed
    CLIENT_VERSION = "unknown"

GOODBYE_TIMEOUT = 1.0

Session = tuple[int | None, str | None]
"""(session id, boot id): the session a request is sent in, and the daemon lifetime it is
sent to."""


class DaemonSession:
    """The sockets, request ids and session of one client (see the module docstring); opened
    by the constructor.

    Args:
        run_dir: The daemon's run directory (resolved).
        name: Model name the session is opened for.
        bytes_per_block: Bytes one block holds in this worker, declared at hello (None: 0).
        bytes_per_format: Bytes one block of each format holds in this worker, declared at
            hello (None: every format costs ``bytes_per_block``).
        weights: Bytes of the model's weights as loaded, declared at hello (the daemon charges
            them to the session; None: not declared).
        overhead: Bytes the worker may hold beyond its weights and KV, declared at hello with
            the weights (charged beside them; None: not declared).
        quantization: With a quantized format in ``bytes_per_format``: how the worker holds a
            sequence's blocks (``--quantized-kv-start``, first-pass slots), declared at hello
            for the daemon's ``fit``.
        timeout: Seconds each call may take, retries included.
        first_retry: Seconds to wait for a reply before the first resend.

    Raises (from the constructor):
        DaemonUnavailableError: The daemon did not answer hello in ``timeout``.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        name: str,
        bytes_per_block: int | Mapping[str, int] | None,
        timeout: float,
        first_retry: float,
        weights: int | None = None,
        bytes_per_format: Mapping[str, int | Mapping[str, int]] | None = None,
        overhead: int | None = None,
        quantization: SequenceQuantization | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.quantization = quantization
        self.bytes_per_format = bytes_per_format
        self.weights = weights
        self.overhead = overhead
        self.endpoint = endpoint(run_dir, WORKER_SOCKET_NAME)
        self.name = name
        self.bytes_per_block = bytes_per_block
        self.timeout = timeout
        self.context: zmq.Context[Any] = zmq.Context()
        self.connection = LazyPirateConnection(self.context, self.endpoint, first_retry=first_retry)
        self.lock = threading.Lock()
        """Held for each call's request and the bookkeeping it implies, so both happen in
        daemon order."""
        self._ids = itertools.count(1)  # next() on it is atomic: no lock needed
        self.closing = threading.Event()
        """Set first thing in close(): parked waiting calls give up within a poll slice."""
        self.closed = False
        self.current: Session = (None, None)
        try:
            hello = self.hello()
        except BaseException:
            self.connection.close()
            self.context.term()
            raise
        self.config: PoolConfig = config_from_wire(hello["config"])
        """The daemon's pool configuration (as of the last hello)."""
        self.streams: tuple[str, ...] = ()
        self.lease = 0.0
        self.heartbeat = 0.0
        """Seconds between heartbeat pings, as the daemon's last hello asked."""
        self.adopt(hello)

    @property
    def session_id(self) -> int | None:
        return self.current[0]

    @property
    def boot_id(self) -> str | None:
        return self.current[1]

    def next_id(self) -> int:
        return next(self._ids)

    def is_current(self, session: Session) -> bool:
        return self.current == session

    def hello(self, resumes: int | None = None) -> dict[str, Any]:
        """Open a session and return the daemon's answer; ``resumes`` names the one this
        client held before a daemon restart (the restarted daemon's claim period waits for
        each session it expects)."""
        args: dict[str, Any] = {
            "pid": os.getpid(),
            "model": self.name,
            "nonce": secrets.token_hex(16),
            "client_version": CLIENT_VERSION,
        }
        bytes_per_block = self.bytes_per_block
        if bytes_per_block is not None:
            args["bytes_per_block"] = (
                bytes_per_block if isinstance(bytes_per_block, int) else dict(bytes_per_block)
            )
        if self.bytes_per_format:
            args["bytes_per_format"] = {
                tag: costs if isinstance(costs, int) else dict(costs)
                for tag, costs in self.bytes_per_format.items()
            }
        if self.quantization is not None:
            args["quantized_kv_start"] = self.quantization.start
            args["first_pass_slots"] = self.quantization.first_pass_slots
        if self.weights is not None:
            args["weights"] = self.weights
            if self.overhead is not None:
                args["overhead"] = self.overhead
        if resumes is not None:
            args["resumes"] = resumes
        rid = self.next_id()
        reply = self.send(encode_request(rid, "hello", args), rid, "hello")
        if not reply["ok"]:
            error = reply["error"]
            refused = error["code"] == ErrorCode.BAD_REQUEST and "'resumes'" in error["message"]
            if resumes is not None and refused:  # a daemon older than the argument
                return self.hello()
            raise error_from_wire(error["code"], error["message"])
        result: dict[str, Any] = reply["result"]
        return result

    def adopt(self, hello: dict[str, Any]) -> None:
        """Take the session a hello opened as this client's."""
        self.current = (hello["sid"], hello["boot"])
        self.streams = tuple(hello["streams"])
        self.lease = hello["lease"]
        self.heartbeat = hello["heartbeat"]

    def send(self, payload: bytes, rid: int, op: str) -> dict[str, Any]:
        """One request on the main connection (resent on silence) and its reply.

        Raises:
            DaemonUnavailableError: No reply within ``timeout``, saying where to look.
        """
        try:
            return self.connection.request(payload, rid, self.timeout, op)
        except DaemonUnavailableError:
            where = self.endpoint.removeprefix("ipc://")
            hint = "" if os.path.exists(where) else f" (there is no socket at {where})"
            raise DaemonUnavailableError(
                f"vqpoold did not answer {op} within {self.timeout:g}s on {self.endpoint}"
                f"{hint}. Is vqpoold running with --run-dir {self.run_dir} (or "
                f"VQPOOL_RUN_DIR)? Check the daemon's log and `vqpoolctl --run-dir "
                f"{self.run_dir} status`."
            ) from None

    def goodbye(self) -> None:
        """End the session at the daemon, briefly: unanswered, the daemon reaps it when this
        process exits. The caller holds the lock."""
        rid = self.next_id()
        payload = encode_request(rid, "goodbye", {}, *self.current)
        with contextlib.suppress(DaemonUnavailableError):
            self.connection.request(payload, rid, GOODBYE_TIMEOUT, "goodbye")

    def wait_for(
        self,
        payload: bytes,
        rid: int,
        *,
        wait: float,
        sent_in: Session,
        what: str,
        on_slice: Callable[[], None] | None = None,
    ) -> dict[str, Any]:
        """A request the daemon may park up to ``wait`` seconds, on a socket of its own
        (see :func:`~vqpool.worker.pool.waiting_call.request_waiting`), given up when the
        client closes or its session is no longer ``sent_in``; ``on_slice`` is called every
        slice of the wait (it may cancel the request at the daemon)."""
        return request_waiting(
            self.context,
            self.endpoint,
            payload,
            rid,
            wait=wait,
            timeout=self.timeout,
            closing=self.closing,
            current=functools.partial(self.is_current, sent_in),
            what=what,
            on_slice=on_slice,
        )
