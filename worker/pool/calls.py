"""One call of a client to vqpoold, with the client's rules around it.

* **Deadline and retries.** A call waits for its reply a bounded time; on silence it reopens its
  socket and resends the same request id (Lazy Pirate, :mod:`~vqpool.worker.pool.session`).
  When ``timeout`` runs out the call raises :class:`DaemonUnavailableError` naming the run
  directory. RETRY_LATER (a restarted daemon's claim period) is retried after a short wait
  until the call's deadline.
* **The way cleared first.** Before a request is sent, the claims of an unfinished re-sync are
  sent (:mod:`~vqpool.worker.pool.resync`) and the allocations given up on are settled
  (:mod:`~vqpool.worker.pool.abandoned`): until then the client's blocks could be freed or
  handed out unknown to it.
* **Refusals.** A reply from another daemon lifetime, or NO_SESSION, means the request was
  refused, not applied: the client re-syncs or re-opens its session and sends the call again,
  unless it names an owner lost on the way.
* **Calls kept for later.** A call that gives back (free, free_all, release_owner, mark_used)
  made while the heartbeat finds the daemon silent, or that went unanswered, is kept and sent
  once the daemon answers again (:mod:`~vqpool.worker.pool.deferred`): a request that ends
  while the daemon is down does not wait for it.
* **Waiting calls.** An allocation that may wait at the daemon (its budget's fair queue) goes
  on a socket of its own without holding the client's lock while parked, so other threads'
  calls go on meanwhile. A thread that makes it inside :meth:`DaemonCalls.cancellable` can
  give it up: once the event is set, the call's own thread sends the ``cancel`` op naming it
  (the daemon answers it CANCELLED, so it leaves its model's queue at once instead of holding
  the model's later requests up until its wait runs out), or does not send it at all.

The heartbeat thread reaches the same state through :class:`DaemonCalls` (it is its
:class:`~vqpool.worker.pool.heartbeat.HeartbeatHost`), for an idle worker.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from vqpool.shared.errors import (
    ClaimConflictError,
    DaemonRestartedError,
    DaemonUnavailableError,
    ErrorCode,
    NoSessionError,
    RequestCancelledError,
    VqpoolError,
    error_from_wire,
)
from vqpool.shared.protocol import CANCEL, encode_request
from vqpool.worker.pool.abandoned import AbandonedAllocation, AbandonedAllocations
from vqpool.worker.pool.deferred import DeferredCalls
from vqpool.worker.pool.holdings import Holdings
from vqpool.worker.pool.lost_owners import LostOwners
from vqpool.worker.pool.resync import SessionResync
from vqpool.worker.pool.session import DaemonSession, Session
from vqpool.worker.pool.waiting_call import Superseded

RETRY_LATER_FIRST_WAIT = 0.02
RETRY_LATER_MAX_WAIT = 0.25
"""Waits between retries of a call the daemon answered RETRY_LATER (its claim period after a
restart): short, since the period usually ends as soon as the workers have re-synced."""

CANCEL_RETRY_SECONDS = 0.1
"""Between two ``cancel`` ops for one waiting call, while the daemon has not received the call
yet (it goes on a socket of its own: the cancel may overtake it)."""

_Result = TypeVar("_Result")


class DaemonCalls:
    """The calls of one client (see the module docstring)."""

    def __init__(
        self, session: DaemonSession, holdings: Holdings, resync: SessionResync, lost: LostOwners
    ) -> None:
        self._session = session
        self._abandoned = AbandonedAllocations(session, holdings)
        self._deferred = DeferredCalls(session)
        self._resync = resync
        self._lost = lost
        self._cancels = threading.local()  # .event: what gives up this thread's waiting calls

    @contextlib.contextmanager
    def cancellable(self, event: threading.Event) -> Iterator[None]:
        """Within the block, a waiting call of this thread is given up once ``event`` is set
        (from any thread): cancelled at the daemon if it was sent, else never sent. Either way
        it raises RequestCancelledError, or returns what the daemon granted before the cancel
        (the caller frees that)."""
        outer = getattr(self._cancels, "event", None)
        self._cancels.event = event
        try:
            yield
        finally:
            self._cancels.event = outer

    def call(self, op: str, args: Mapping[str, Any]) -> Any:
        """One request/reply and its result; the caller holds the lock.

        Raises:
            VqpoolError: The daemon's refusal, DaemonUnavailableError on silence,
                ClaimConflictError when the call names an owner lost meanwhile.
        """
        session = self._session
        deadline = time.monotonic() + session.timeout
        wait = RETRY_LATER_FIRST_WAIT
        n_resyncs = 0
        while True:
            self._clear_the_way()
            rid = session.next_id()
            boot = session.boot_id
            payload = encode_request(rid, op, args, *session.current)
            reply = session.send(payload, rid, op)
            resynced = self._resync.after_refusal(op, reply, boot, n_resyncs)
            if resynced is not None:
                n_resyncs = resynced
                lost = self._lost.reason_in(args)
                if lost is None:
                    continue
                if op in ("free_all", "release_owner"):
                    self._lost.forget(args["owner"])  # nothing left to free or release
                    return None
                raise ClaimConflictError(lost)
            if reply["ok"]:
                return reply.get("result")
            error = reply["error"]
            if error["code"] == ErrorCode.RETRY_LATER and time.monotonic() + wait < deadline:
                time.sleep(wait)
                wait = min(wait * 2, RETRY_LATER_MAX_WAIT)
                continue
            raise error_from_wire(error["code"], error["message"])

    def call_or_keep(self, op: str, args: Mapping[str, Any], daemon_silent: bool) -> None:
        """A call that gives back (:data:`~vqpool.worker.pool.deferred.DEFERRED_OPS`): sent,
        or kept to be sent once the daemon answers, without waiting, when ``daemon_silent``
        (the heartbeat's finding), or after the call went unanswered. The caller holds the
        lock, and forgets what the call gives back either way.

        Raises:
            VqpoolError: The daemon's refusal (nothing kept), DaemonRestartedError or
                NoSessionError for an unusable or closed client.
        """
        if not daemon_silent:
            try:
                self.call(op, args)
                return
            except DaemonUnavailableError:
                pass  # kept below
        if self._resync.unusable is not None:
            raise DaemonRestartedError(self._resync.unusable)
        if self._session.closed:
            raise NoSessionError(f"PoolClient for {self._session.run_dir} is closed")
        self._deferred.add(op, dict(args))

    @property
    def n_kept(self) -> int:
        """Calls kept while the daemon did not answer, not sent yet."""
        return len(self._deferred)

    def call_waiting(
        self,
        op: str,
        args: Mapping[str, Any],
        wait: float,
        adopt: Callable[[Any], _Result],
    ) -> _Result:
        """An allocation that may wait ``wait`` seconds at the daemon, sent without holding
        the lock while parked (other threads keep calling free, mark_used, ...).

        The lock is held only to build the request (request id, the current session) and to
        handle its reply: ``adopt(result)`` records the blocks under the lock. A parked call
        whose session is replaced meanwhile (the heartbeat met a restarted daemon, or an
        eviction) stops waiting at once and is sent in the new one. The rules of :meth:`call`
        apply: a reply from another daemon lifetime or NO_SESSION re-syncs or reopens the
        session and the call is sent again (with the wait left), RETRY_LATER is retried. A
        reply to a session this client no longer has (another thread re-synced or reopened
        it meanwhile) is void: those blocks went with the old session, and the call is sent
        again. A call given up on (no reply in time) is kept to settle
        (:mod:`~vqpool.worker.pool.abandoned`).
        """
        session = self._session
        end = time.monotonic() + wait
        pause = RETRY_LATER_FIRST_WAIT
        n_resyncs = 0
        cancel: threading.Event | None = getattr(self._cancels, "event", None)
        while True:
            with session.lock:
                if cancel is not None and cancel.is_set():
                    raise RequestCancelledError(f"{op}: given up before it was sent")
                self._clear_the_way()
                lost = self._lost.reason_in(args)
                if lost is not None:
                    raise ClaimConflictError(lost)
                left = max(0.0, end - time.monotonic())
                sent_in = session.current
                rid = session.next_id()
                sent_args = {**args, "wait": left} if left > 0 else args
                payload = encode_request(rid, op, sent_args, *sent_in)
            on_slice = None if cancel is None else self._canceller(cancel, sent_in, rid)
            try:
                reply = session.wait_for(
                    payload, rid, wait=left, sent_in=sent_in, what=op, on_slice=on_slice
                )
            except Superseded:
                continue  # re-synced or reopened by another thread: send it in the new session
            except DaemonUnavailableError:
                with session.lock:
                    if session.current == sent_in:  # else its blocks went with that session
                        self._abandoned.add(AbandonedAllocation(sent_in, rid, op, dict(args), left))
                raise DaemonUnavailableError(
                    f"vqpoold did not answer {op} (wait {left:g}s) within "
                    f"{left + session.timeout:g}s on {session.endpoint}: is it running with "
                    f"--run-dir {session.run_dir}?"
                ) from None
            with session.lock:
                if session.current != sent_in:
                    continue  # re-synced or reopened by another thread: void, send again
                resynced = self._resync.after_refusal(op, reply, sent_in[1], n_resyncs)
                if resynced is not None:
                    n_resyncs = resynced
                    continue  # a lost owner is refused at the top of the loop
                if reply["ok"]:
                    return adopt(reply.get("result"))
                error = reply["error"]
                retry = error["code"] == ErrorCode.RETRY_LATER
                if not retry or time.monotonic() + pause >= end + session.timeout:
                    raise error_from_wire(error["code"], error["message"])
            time.sleep(pause)
            pause = min(pause * 2, RETRY_LATER_MAX_WAIT)

    def _canceller(self, event: threading.Event, sent_in: Session, rid: int) -> Callable[[], None]:
        """What a waiting call ``rid`` (sent in ``sent_in``) does each slice of its wait: once
        ``event`` is set, ask the daemon to cancel it, until the daemon has it (it then answers
        the call CANCELLED, or the call was answered already and that reply comes)."""
        session = self._session
        next_try = 0.0

        def on_slice() -> None:
            nonlocal next_try
            now = time.monotonic()
            if not event.is_set() or now < next_try:
                return
            next_try = now + CANCEL_RETRY_SECONDS
            with session.lock:
                if session.current != sent_in or session.closed:
                    return  # the call's wait ends by itself (Superseded, closing)
                cancel_rid = session.next_id()
                payload = encode_request(cancel_rid, CANCEL, {"request": rid}, *sent_in)
                try:
                    reply = session.send(payload, cancel_rid, CANCEL)
                except VqpoolError:
                    return  # try again next slice
            if reply["ok"] or reply["error"]["code"] != ErrorCode.BAD_REQUEST:
                # Cancelled, answered already, or a daemon that cannot cancel (the call then
                # waits as before): nothing more to send.
                next_try = math.inf

        return on_slice

    def _clear_the_way(self) -> None:
        """Send what must go before any request: the claims of an unfinished re-sync, then
        the settling of allocations given up on. The caller holds the lock.

        Raises:
            DaemonRestartedError: The client is unusable.
            NoSessionError: The client is closed.
        """
        while True:
            if self._resync.unusable is not None:
                raise DaemonRestartedError(self._resync.unusable)
            if self._session.closed:
                raise NoSessionError(f"PoolClient for {self._session.run_dir} is closed")
            if self._resync.claims_due:
                self._resync.send_claims()
            elif self._abandoned:
                self._abandoned.settle()
            elif self._deferred:
                self._deferred.settle()
            else:
                return

    # -- for the heartbeat (HeartbeatHost) --------------------------------------------------------

    def resync_due(self) -> bool:
        return bool(self._resync.claims_due)

    def settle_due(self) -> bool:
        return bool(self._abandoned) or bool(self._deferred)

    def resync_from_heartbeat(self, seen_boot: object) -> None:
        """Re-sync now, for an idle worker whose heartbeat met a restarted daemon."""
        with self._session.lock:
            if self._session.closed or self._resync.unusable is not None:
                return  # pointless
            with contextlib.suppress(DaemonUnavailableError, DaemonRestartedError):
                if seen_boot != self._session.boot_id:
                    self._resync.resync()
                elif self._resync.claims_due:  # a re-sync cut short by a timeout
                    self._resync.send_claims()

    def reopen_from_heartbeat(self, seen: Session) -> None:
        """Open a new session now, for a worker whose heartbeat found ``seen`` ended."""
        with self._session.lock:
            session = self._session
            if session.closed or self._resync.unusable is not None or session.current != seen:
                return  # closing, unusable, or re-opened by a call already
            with contextlib.suppress(DaemonUnavailableError, DaemonRestartedError):
                self._resync.reopen()

    def settle_from_heartbeat(self) -> None:
        """Settle the allocations given up on and send the calls kept now, for an idle
        worker."""
        with self._session.lock:
            if self._session.closed or self._resync.unusable is not None:
                return
            with contextlib.suppress(DaemonUnavailableError):
                self._abandoned.settle()
                self._deferred.settle()
