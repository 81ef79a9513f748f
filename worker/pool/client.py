"""PoolClient: the daemon's block pool, seen from one worker process.

A :class:`PoolClient` has the methods, signatures, return types and exceptions of the local
:class:`~vqpool.shared.allocator.BlockPoolAllocator` (it satisfies
:class:`~vqpool.shared.pool.BlockPool`), so a pooled KV cache runs unchanged on either. Each
call is one request to ``vqpoold``:

* **Deadline and retries.** A call waits for its reply a bounded time; on silence it reopens its
  socket and resends the same request id (Lazy Pirate). The daemon answers a repeated id from
  its reply cache, so a lost reply costs a resend, never a leaked or doubled allocation. When
  ``timeout`` runs out the call raises :class:`DaemonUnavailableError` naming the run directory.
* **Lease.** A background thread pings the daemon on its own socket every lease / 4, so the
  lease stays fresh while the caller's thread is busy (a long prefill) without sharing its
  socket.
* **Threads.** Calls from several threads are serialized on one lock: each call's request and
  the local bookkeeping it implies happen in daemon order.
* **Restarts.** The daemon's boot id comes with every reply. When it changes (the daemon was
  killed or stopped and started again), the client re-syncs before anything else: it says hello
  to the new daemon and re-declares (``claim``) every owner it holds with its blocks' ids,
  streams, fill and format, then repeats the interrupted call. The heartbeat does the same for
  an idle worker. The caller sees nothing but a slower call; the daemon answers allocations with
  RETRY_LATER during its claim period, and the client retries those by itself. An owner whose
  claim the daemon refuses (a block already claimed by another worker, or outside the new
  pool) is *lost*: its blocks are forgotten here and every call naming it raises
  :class:`ClaimConflictError` until ``free_all`` or ``release_owner`` forgets it. A daemon
  restarted with another block size or stream split cannot take claims: every call raises
  :class:`DaemonRestartedError` from then on. See docs/reliability.md.
* **Eviction.** A session the daemon ended while this process lives (``vqpoolctl evict``, or
  an expired lease) freed every block it held: on the first NO_SESSION reply, to a call or to
  the heartbeat, every owner held becomes lost (as in a restart conflict: calls naming it raise
  ClaimConflictError, ``free_all`` forgets it) and a new session is opened; the interrupted
  call is sent again unless it names a lost owner.

The client keeps the :class:`Block` objects it handed out, as the local allocator does, so
``free``/``free_all``/``mark_used`` update the caller's objects the same way.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

import zmq
from vqpool.shared.allocator import (
    DEFAULT_HISTORY_SIZE,
    AllocationStats,
    Block,
    Owner,
    PoolConfig,
)
from vqpool.shared.config import WORKER_SOCKET_NAME, endpoint, resolve_run_dir
from vqpool.shared.errors import (
    ClaimConflictError,
    DaemonRestartedError,
    DaemonUnavailableError,
    ErrorCode,
    NoSessionError,
    error_from_wire,
)
from vqpool.shared.pool import AllocationRequest, AllocationResult
from vqpool.shared.protocol import (
    MAX_BATCH,
    config_from_wire,
    encode_request,
    item_message,
    session_label,
    stats_from_wire,
)
from vqpool.shared.transport import FIRST_RETRY_SECONDS, LazyPirateConnection
from vqpool.worker.pool.abandoned import AbandonedAllocation, granted_ids
from vqpool.worker.pool.reclaim_listener import ReclaimHandler, ReclaimListener
from vqpool.worker.pool.waiting_call import Superseded, request_waiting

log = logging.getLogger("vqpool.worker")

try:
    CLIENT_VERSION = version("vqpool")
except PackageNotFoundError:  # a source tree that is not installed
    CLIENT_VERSION = "unknown"

DEFAULT_TIMEOUT = 10.0
"""Seconds a call may take, retries included, before DaemonUnavailableError."""

_GOODBYE_TIMEOUT = 1.0

LOAD_REPORT_GAP = 0.1
"""Seconds the heartbeat waits after a load change before sending it: changes in between go in
the same ping, so a busy worker sends at most ~10 extra pings a second."""

RETRY_LATER_FIRST_WAIT = 0.02
RETRY_LATER_MAX_WAIT = 0.25
"""Waits between retries of a call the daemon answered RETRY_LATER (its claim period after a
restart): short, since the period usually ends as soon as the workers have re-synced."""

CLAIM_IDS_PER_MESSAGE = 16384
"""Block ids per claim message when re-declaring many blocks (well inside the 1 MiB frame)."""

MAX_RESYNCS_PER_CALL = 3
"""A call that meets this many daemon restarts in a row gives up with DaemonRestartedError."""

MAX_ALLOCATE_WAIT = 60.0
"""The longest ``wait`` an allocation may ask the daemon for (the protocol's bound)."""


_Result = TypeVar("_Result")


def _check_wait(wait: float) -> float:
    if not 0.0 <= wait <= MAX_ALLOCATE_WAIT:
        raise ValueError(f"wait must be in 0..{MAX_ALLOCATE_WAIT:g} seconds, got {wait!r}")
    return wait


class PoolClient:
    """A session with ``vqpoold`` that behaves as a :class:`~vqpool.shared.pool.BlockPool`.

    Example::

        with PoolClient(name="llama-3b") as pool:
            blocks = pool.allocate("k", 40, owner="req-1")
            ...
            pool.free_all("req-1")

    Args:
        run_dir: The daemon's run directory; None resolves it as the daemon does
            (``VQPOOL_RUN_DIR``, then ``$XDG_RUNTIME_DIR/vqpool`` or ``$TMPDIR/vqpool``).
        name: Model name this worker serves (shown by the admin ``sessions`` op).
        bytes_per_block: Bytes one block holds in this worker, for all streams (int) or per
            stream (map); lets the admin report memory held. None reports 0.
        timeout: Seconds each call may take, retries included.
        first_retry: Seconds to wait for a reply before the first resend (doubled per silent
            attempt, up to 2 s).
        on_reclaim: A reclaim handler (see :meth:`set_reclaim_handler`); None: this worker is
            never asked to give memory back.

    Raises (from the constructor):
        DaemonUnavailableError: The daemon did not answer hello in ``timeout``.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None = None,
        *,
        name: str,
        bytes_per_block: int | Mapping[str, int] | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        first_retry: float = FIRST_RETRY_SECONDS,
        on_reclaim: ReclaimHandler | None = None,
    ) -> None:
        self.run_dir = resolve_run_dir(run_dir)
        self.name = name
        self.timeout = timeout
        self._endpoint = endpoint(self.run_dir, WORKER_SOCKET_NAME)
        self._context: zmq.Context[Any] = zmq.Context()
        self._connection = LazyPirateConnection(
            self._context, self._endpoint, first_retry=first_retry
        )
        self._lock = threading.Lock()
        # One counter for the caller's requests and the heartbeat's (next() on it is atomic).
        self._ids = itertools.count(1)
        self._bytes_per_block = bytes_per_block
        self._blocks: dict[int, Block] = {}
        # Owners this session holds (registered, or holding blocks) -> their block ids in
        # allocation order: what a re-sync re-declares.
        self._owners: dict[Owner, dict[int, None]] = {}
        self._lost: dict[Owner, str] = {}
        self._lost_blocks: dict[int, Owner] = {}
        self._unusable: str | None = None
        self._closed = False
        # Set first thing in close(): parked waiting calls give up within a poll slice.
        self._closing = threading.Event()
        # The claims of a re-sync not answered yet: (request id, owners, done) per message.
        self._claims_due: list[tuple[int, list[list[Any]], bool]] = []
        # Set by the heartbeat when a ping goes unanswered, cleared by its next answered one.
        self._daemon_silent = False
        # Waiting allocations given up on, to settle before anything else is sent.
        self._abandoned: list[AbandonedAllocation] = []
        self._resync_record: dict[str, Any] = {}
        self._resync_started = 0.0
        self.session_id: int | None = None
        self.boot_id: str | None = None
        # (session id, boot id) as one value, so the heartbeat never reads a half-updated pair.
        self._session: tuple[int | None, str | None] = (None, None)
        # (running, queued, preemptions or None) as last given to report_load(); the heartbeat
        # sends it.
        self._load: tuple[int, int, int | None] | None = None
        # The preemption count reported when the current session opened: the daemon counts per
        # session, so a new session (re-sync, reopen) is sent the count since then.
        self._preemptions_base = 0
        self._reclaim: ReclaimListener | None = None
        # The prompt cache's counters as last given to report_prompt_cache(); sent likewise,
        # until a daemon older than the argument refuses it.
        self._prompt_cache: dict[str, int] | None = None
        self._prompt_cache_refused = False
        self.on_advice: Callable[[dict[str, Any]], None] | None = None
        """Called (on the heartbeat thread, no lock held) with what the daemon's answer to a
        load report asks of this worker: ``{drop_cache: true}`` or ``{release_bytes: n}``."""
        self.resyncs: list[dict[str, Any]] = []
        """One record per re-sync: ``{boot, seconds, owners_claimed, owners_refused,
        blocks_claimed}``."""
        try:
            hello = self._hello()
        except BaseException:
            self._connection.close()
            self._context.term()
            raise
        self._config = config_from_wire(hello["config"])
        self._adopt(hello)
        self._heartbeat = _Heartbeat(self, hello["heartbeat"])
        self._heartbeat.start()
        if on_reclaim is not None:
            self.set_reclaim_handler(on_reclaim)

    # -- plumbing --------------------------------------------------------------------------------

    def _hello(self, resumes: int | None = None) -> dict[str, Any]:
        """Open a session; ``resumes`` names the one this client held before a daemon restart
        (the restarted daemon's claim period waits for each session it expects)."""
        args: dict[str, Any] = {
            "pid": os.getpid(),
            "model": self.name,
            "nonce": secrets.token_hex(16),
            "client_version": CLIENT_VERSION,
        }
        bytes_per_block = self._bytes_per_block
        if bytes_per_block is not None:
            args["bytes_per_block"] = (
                bytes_per_block if isinstance(bytes_per_block, int) else dict(bytes_per_block)
            )
        if resumes is not None:
            args["resumes"] = resumes
        rid = next(self._ids)
        reply = self._send(encode_request(rid, "hello", args), rid, "hello")
        if not reply["ok"]:
            error = reply["error"]
            refused = error["code"] == ErrorCode.BAD_REQUEST and "'resumes'" in error["message"]
            if resumes is not None and refused:  # a daemon older than the argument
                return self._hello()
            raise error_from_wire(error["code"], error["message"])
        result: dict[str, Any] = reply["result"]
        return result

    def _adopt(self, hello: dict[str, Any]) -> None:
        """Take the session a hello opened as this client's."""
        self.session_id = hello["sid"]
        self.boot_id = hello["boot"]
        load = self._load
        self._preemptions_base = (load[2] or 0) if load is not None else 0
        self._session = (self.session_id, self.boot_id)
        self._streams: tuple[str, ...] = tuple(hello["streams"])
        self.lease: float = hello["lease"]

    def _send(self, payload: bytes, rid: int, op: str) -> dict[str, Any]:
        try:
            return self._connection.request(payload, rid, self.timeout, op)
        except DaemonUnavailableError:
            where = self._endpoint.removeprefix("ipc://")
            hint = "" if os.path.exists(where) else f" (there is no socket at {where})"
            raise DaemonUnavailableError(
                f"vqpoold did not answer {op} within {self.timeout:g}s on {self._endpoint}"
                f"{hint}. Is vqpoold running with --run-dir {self.run_dir} (or "
                f"VQPOOL_RUN_DIR)? Check the daemon's log and `vqpoolctl --run-dir "
                f"{self.run_dir} status`."
            ) from None

    def _call(self, op: str, args: Mapping[str, Any]) -> Any:
        """One request/reply; the caller holds ``self._lock``.

        A reply from another daemon lifetime means the request was refused, not applied: the
        client re-syncs with that daemon and sends the call again. RETRY_LATER (a restarted
        daemon's claim period) is retried after a short wait until the call's deadline.
        """
        deadline = time.monotonic() + self.timeout
        wait = RETRY_LATER_FIRST_WAIT
        n_resyncs = 0
        while True:
            if self._unusable is not None:
                raise DaemonRestartedError(self._unusable)
            if self._closed:
                raise NoSessionError(f"PoolClient for {self.run_dir} is closed")
            if self._claims_due:
                self._send_claims()
                continue
            if self._abandoned:
                self._settle_abandoned()
                continue
            rid = next(self._ids)
            payload = encode_request(rid, op, args, self.session_id, self.boot_id)
            reply = self._send(payload, rid, op)
            resynced = self._resync_if_refused(op, reply, self.boot_id, n_resyncs)
            if resynced is not None:
                n_resyncs = resynced
                lost = self._lost_in(args)
                if lost is None:
                    continue
                if op in ("free_all", "release_owner"):
                    self._forget_lost(args["owner"])  # nothing left to free or release
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

    def _call_waiting(
        self,
        op: str,
        args: Mapping[str, Any],
        wait: float,
        adopt: Callable[[Any], _Result],
    ) -> _Result:
        """An allocation that may wait ``wait`` seconds at the daemon, sent without holding
        ``self._lock`` while parked (other threads keep calling free, mark_used, ...).

        The lock is held only to build the request (request id from the client's counter,
        the current session) and to handle its reply: ``adopt(result)`` records the blocks
        under the lock. A parked call whose session is replaced meanwhile (the heartbeat met a
        restarted daemon, or an eviction) stops waiting at once and is sent in the new one.
        The rules of :meth:`_call` apply: a reply from another daemon lifetime
        or NO_SESSION re-syncs or reopens the session and the call is sent again (with the wait
        left), RETRY_LATER is retried. A reply to a session this client no longer has (another
        thread re-synced or reopened it meanwhile) is void: those blocks went with the old
        session, and the call is sent again.
        """
        end = time.monotonic() + wait
        pause = RETRY_LATER_FIRST_WAIT
        n_resyncs = 0
        while True:
            with self._lock:
                if self._unusable is not None:
                    raise DaemonRestartedError(self._unusable)
                if self._closed:
                    raise NoSessionError(f"PoolClient for {self.run_dir} is closed")
                if self._claims_due:
                    self._send_claims()
                    continue
                if self._abandoned:
                    self._settle_abandoned()
                    continue
                lost = self._lost_in(args)
                if lost is not None:
                    raise ClaimConflictError(lost)
                left = max(0.0, end - time.monotonic())
                session = self._session
                rid = next(self._ids)
                sent_args = {**args, "wait": left} if left > 0 else args
                payload = encode_request(rid, op, sent_args, *session)
            try:
                reply = request_waiting(
                    self._context,
                    self._endpoint,
                    payload,
                    rid,
                    wait=left,
                    timeout=self.timeout,
                    closing=self._closing,
                    current=functools.partial(self._is_session, session),
                    what=op,
                )
            except Superseded:
                continue  # re-synced or reopened by another thread: send it in the new session
            except DaemonUnavailableError:
                with self._lock:
                    if self._session == session:  # else its blocks went with that session
                        self._abandoned.append(
                            AbandonedAllocation(session, rid, op, dict(args), left)
                        )
                raise DaemonUnavailableError(
                    f"vqpoold did not answer {op} (wait {left:g}s) within "
                    f"{left + self.timeout:g}s on {self._endpoint}: is it running with "
                    f"--run-dir {self.run_dir}?"
                ) from None
            with self._lock:
                if self._session != session:
                    continue  # re-synced or reopened by another thread: void, send again
                resynced = self._resync_if_refused(op, reply, session[1], n_resyncs)
                if resynced is not None:
                    n_resyncs = resynced
                    continue  # a lost owner is refused at the top of the loop
                if reply["ok"]:
                    return adopt(reply.get("result"))
                error = reply["error"]
                retry = error["code"] == ErrorCode.RETRY_LATER
                if not retry or time.monotonic() + pause >= end + self.timeout:
                    raise error_from_wire(error["code"], error["message"])
            time.sleep(pause)
            pause = min(pause * 2, RETRY_LATER_MAX_WAIT)

    def _resync_if_refused(
        self, op: str, reply: dict[str, Any], boot: str | None, n_resyncs: int
    ) -> int | None:
        """The restart and eviction rules of a call, shared by :meth:`_call` and
        :meth:`_call_waiting`. The caller holds ``self._lock``.

        A reply from another daemon lifetime than ``boot`` (the one the request was sent to) or
        NO_SESSION means the request was refused, not applied: re-sync with the restarted daemon,
        or open a new session, and return the count of such refusals in this call, now
        ``n_resyncs + 1``; the caller checks for owners lost on the way and sends the call again.
        None: ``reply`` is the call's own answer.

        Raises:
            DaemonRestartedError: More than MAX_RESYNCS_PER_CALL restarts in one call, or a
                restarted daemon whose pool the blocks held here cannot be claimed in.
            NoSessionError: More than MAX_RESYNCS_PER_CALL sessions ended in a row.
            DaemonUnavailableError: The daemon did not answer hello.
        """
        if reply.get("boot") != boot:
            if n_resyncs >= MAX_RESYNCS_PER_CALL:
                raise DaemonRestartedError(
                    f"{op}: vqpoold restarted {n_resyncs + 1} times during one call; giving up"
                )
            self._resync()
            return n_resyncs + 1
        if not reply["ok"] and reply["error"]["code"] == ErrorCode.NO_SESSION and not self._closed:
            if n_resyncs >= MAX_RESYNCS_PER_CALL:
                raise NoSessionError(f"{op}: the daemon ended {n_resyncs + 1} sessions in a row")
            self._reopen_session()
            return n_resyncs + 1
        return None

    def _is_session(self, session: tuple[int | None, str | None]) -> bool:
        return self._session == session

    def _settle_abandoned(self) -> None:
        """Free what the waiting allocations this client gave up on were granted, if anything
        (see worker/pool/abandoned.py). The caller holds ``self._lock``.

        Raises:
            DaemonUnavailableError: The daemon did not answer (the rest stays due).
        """
        while self._abandoned:
            abandoned = self._abandoned[0]
            if abandoned.session != self._session:
                del self._abandoned[0]  # a restart or an eviction freed what it held
                continue
            if abandoned.free is None:
                # The same id without ``wait``: the daemon's answer to the request it got.
                payload = encode_request(
                    abandoned.rid, abandoned.op, abandoned.args, *self._session
                )
                try:
                    reply = request_waiting(
                        self._context,
                        self._endpoint,
                        payload,
                        abandoned.rid,
                        wait=abandoned.wait,
                        timeout=self.timeout,
                        closing=self._closing,
                        current=functools.partial(self._is_session, abandoned.session),
                        what=f"{abandoned.op} (given up on before)",
                    )
                except Superseded:
                    continue
                ids = []
                if reply.get("boot") == abandoned.session[1] and reply["ok"]:
                    ids = granted_ids(abandoned.op, reply.get("result"))
                if not ids:  # refused, never applied, or by a daemon that since restarted
                    del self._abandoned[0]
                    continue
                rid = next(self._ids)
                free = encode_request(rid, "free", {"block_ids": ids}, *self._session)
                abandoned.free = (rid, free)
            rid, free = abandoned.free
            self._send(free, rid, "free")
            del self._abandoned[0]
            for owner in abandoned.owners():
                if self._owners.get(owner) == {}:  # its only blocks: the daemon released it
                    del self._owners[owner]

    # -- re-sync after a daemon restart or an eviction --------------------------------------------

    def _reopen_session(self) -> None:
        """The daemon ended this live session (an admin eviction, or its lease ran out) and
        freed its blocks: every owner held is lost, as in a restart conflict, and a new
        session is opened. Until it is, ``session_id`` is None.

        The caller holds ``self._lock``.

        Raises:
            DaemonUnavailableError: The daemon did not answer hello (the next call retries).
        """
        for owner in list(self._owners):
            self._forget_as_lost(
                owner,
                f"owner {owner!r} was lost: vqpoold ended this worker's session (evicted, or "
                f"its lease ran out) and freed its blocks; free_all({owner!r}) forgets it.",
            )
        self.session_id = None
        self._session = (None, self.boot_id)
        hello = self._hello()
        self._adopt(hello)
        self._heartbeat.interval = hello["heartbeat"]

    def _lost_in(self, args: Mapping[str, Any]) -> str | None:
        """Why a call with ``args`` names a lost owner or a block of one; None if it does not."""
        owners = [args.get("owner")] + [item[2] for item in args.get("items", ())]
        for owner in owners:
            if owner is not None and owner in self._lost:
                return self._lost[owner]
        block_ids = list(args.get("block_ids", ())) + [u[0] for u in args.get("updates", ())]
        for block_id in block_ids:
            if block_id in self._lost_blocks:
                return self._lost[self._lost_blocks[block_id]]
        return None

    def reopen_from_heartbeat(self, seen: tuple[int | None, str | None]) -> None:
        """Open a new session now, for a worker whose heartbeat found ``seen`` ended."""
        with self._lock:
            if self._closed or self._unusable is not None or self._session != seen:
                return  # closing, unusable, or re-opened by a call already
            with contextlib.suppress(DaemonUnavailableError, DaemonRestartedError):
                self._reopen_session()

    def _resync(self) -> None:
        """Open a session with the restarted daemon and claim back everything held here.

        The caller holds ``self._lock``. Owners the daemon refuses become lost.

        Raises:
            DaemonRestartedError: The new daemon's pool has another block size or stream split:
                the blocks held here mean nothing to it (the client is unusable from now on).
            DaemonUnavailableError: The new daemon did not answer (claims not answered yet stay
                due: see :meth:`_send_claims`).
        """
        started = time.monotonic()
        hello = self._hello(resumes=self.session_id)
        config = config_from_wire(hello["config"])
        old = self._config
        if (config.block_size, config.separate_kv) != (old.block_size, old.separate_kv):
            self._unusable = (
                f"vqpoold restarted with another pool (block size {config.block_size}, "
                f"separate_kv {config.separate_kv}; was {old.block_size}, {old.separate_kv}): "
                f"the blocks this client held cannot be claimed back. Restart vqpoold with the "
                f"options it had, or open a new PoolClient for {self.run_dir}."
            )
            raise DaemonRestartedError(self._unusable)
        self._config = config
        self._adopt(hello)
        self._heartbeat.interval = hello["heartbeat"]
        # Encoded once, ids fixed: a claim whose reply is lost is resent as the same request,
        # which the daemon answers from its reply cache instead of claiming twice.
        self._claims_due = [
            (next(self._ids), entries, done) for entries, done in self._claim_messages()
        ]
        self._resync_record = {
            "boot": self.boot_id,
            "seconds": 0.0,
            "owners_claimed": 0,
            "owners_refused": 0,
            "blocks_claimed": 0,
        }
        self._resync_started = started
        self._send_claims()

    def _send_claims(self) -> None:
        """Send the claims of the current re-sync that are still unanswered.

        The caller holds ``self._lock``. Until every claim is answered, the client must send
        nothing else: its blocks are free in the new daemon's eyes, so a free or fill update of
        one would be skipped there and the claim would then take it back unknown to the caller.
        A call that times out here leaves the rest due; the next call (or heartbeat) sends it.

        Raises:
            DaemonUnavailableError: A claim went unanswered (the rest stays due).
        """
        record = self._resync_record
        while self._claims_due:
            rid, entries, done = self._claims_due[0]
            payload = encode_request(
                rid, "claim", {"owners": entries, "done": done}, self.session_id, self.boot_id
            )
            reply = self._send(payload, rid, "claim")
            if reply.get("boot") != self.boot_id:
                self._resync()  # restarted again mid-way: start over with that one
                return
            del self._claims_due[0]
            # A refused message (not a per-owner refusal) loses every owner in it.
            results = reply["result"] if reply["ok"] else [reply["error"]] * len(entries)
            for (owner, groups), result in zip(entries, results, strict=True):
                if result is None:
                    record["owners_claimed"] += 1
                    record["blocks_claimed"] += sum(len(group[2]) for group in groups)
                else:
                    record["owners_refused"] += 1
                    self._mark_lost(owner, result["code"], item_message(results, result))
        record["seconds"] = time.monotonic() - self._resync_started
        self.resyncs.append(record)

    def _claim_messages(self) -> Iterator[tuple[list[list[Any]], bool]]:
        """Claim messages re-declaring every owner held (one, empty, when none is)."""
        block_size = self._config.block_size
        entries: list[list[Any]] = []
        n_ids = 0
        for owner, ids in self._owners.items():
            groups: dict[tuple[str, str], tuple[list[int], list[int]]] = {}
            for block_id in ids:
                block = self._blocks[block_id]
                group_ids, fills = groups.setdefault((block.stream, block.format), ([], []))
                group_ids.append(block_id)
                fills.append(block.n_used)
            wire = [
                [stream, fmt, group_ids, None if min(fills) == block_size else fills]
                for (stream, fmt), (group_ids, fills) in groups.items()
            ]
            if entries and (n_ids + len(ids) > CLAIM_IDS_PER_MESSAGE or len(entries) >= MAX_BATCH):
                yield entries, False
                entries, n_ids = [], 0
            entries.append([owner, wire])
            n_ids += len(ids)
        yield entries, True

    def _mark_lost(self, owner: Owner, code: int, message: str) -> None:
        """Forget ``owner``'s blocks: the restarted daemon did not give them back to us."""
        text = (
            f"owner {owner!r} was lost in a vqpoold restart: its claim was refused "
            f"({ErrorCode(code).name if code in ErrorCode._value2member_map_ else code}: "
            f"{message}). Its blocks are no longer this worker's; free_all({owner!r}) forgets it."
        )
        self._forget_as_lost(owner, text)

    def _forget_as_lost(self, owner: Owner, text: str) -> None:
        """Forget ``owner``'s blocks; calls naming it raise ClaimConflictError(``text``)."""
        self._lost[owner] = text
        for block_id in self._owners.pop(owner, {}):
            self._lost_blocks[block_id] = owner
            block = self._blocks.pop(block_id, None)
            if block is not None:
                block.owner = None

    def _refuse_lost(self, owner: Owner) -> None:
        message = self._lost.get(owner)
        if message is not None:
            raise ClaimConflictError(message)

    def _refuse_lost_blocks(self, block_ids: Iterable[int]) -> None:
        lost = self._lost_blocks
        if lost:
            for block_id in block_ids:
                owner = lost.get(block_id)
                if owner is not None:
                    raise ClaimConflictError(self._lost[owner])

    def _forget_lost(self, owner: Owner) -> bool:
        """Forget a lost owner (free_all/release_owner of it); whether it was lost."""
        if self._lost.pop(owner, None) is None:
            return False
        for block_id in [b for b, o in self._lost_blocks.items() if o == owner]:
            del self._lost_blocks[block_id]
        return True

    def session_problem(self) -> str | None:
        """Why this client cannot use a pool session right now, or None when it can: the
        daemon ended it and a new one is not open yet, the daemon did not answer the last
        heartbeat (stopped, or restarting), or a restarted daemon has not taken back all the
        blocks held here yet. No round trip: what the heartbeat and the calls last saw."""
        if self._unusable is not None:
            return self._unusable
        if self.session_id is None:
            return "no pool session (evicted?); opening a new one"
        if self._daemon_silent:
            return (
                f"vqpoold does not answer on {self._endpoint} (stopped or restarting?); the "
                f"session resumes when it is back"
            )
        if self._claims_due:
            return "re-declaring the blocks held here to a restarted vqpoold"
        return None

    def lost_owners(self) -> dict[Owner, str]:
        """Owners lost in a daemon restart (their claim was refused), with the reason."""
        with self._lock:
            return dict(self._lost)

    def resync_from_heartbeat(self, seen_boot: object) -> None:
        """Re-sync now, for an idle worker whose heartbeat met a restarted daemon."""
        with self._lock:
            if self._closed or self._unusable is not None:
                return  # pointless
            with contextlib.suppress(DaemonUnavailableError, DaemonRestartedError):
                if seen_boot != self.boot_id:
                    self._resync()
                elif self._claims_due:  # a re-sync cut short by a timeout
                    self._send_claims()

    def settle_from_heartbeat(self) -> None:
        """Settle the abandoned allocations now, for an idle worker (see _settle_abandoned)."""
        with self._lock:
            if self._closed or self._unusable is not None:
                return
            with contextlib.suppress(DaemonUnavailableError):
                self._settle_abandoned()

    def _blocks_from_ids(
        self, block_ids: list[int], stream: str, n_tokens: int, owner: Owner, fmt: str
    ) -> list[Block]:
        """The Block objects of an allocate reply (fill is implied: full but the last)."""
        block_size = self._config.block_size
        resolved = stream if self._config.separate_kv else "kv"
        blocks = [Block(bid, resolved, fmt, block_size, owner, True) for bid in block_ids]
        if blocks:
            blocks[-1].n_used = n_tokens - (len(blocks) - 1) * block_size
        held = self._blocks
        owned = self._owners.setdefault(owner, {})
        for block in blocks:
            held[block.block_id] = block
            owned[block.block_id] = None
        return blocks

    def _forget(self, block_id: int) -> Block | None:
        block = self._blocks.pop(block_id, None)
        if block is not None:
            owned = self._owners.get(block.owner)  # type: ignore[arg-type]
            if owned is not None:
                owned.pop(block_id, None)
                if not owned:  # its last block: the daemon released the owner too
                    del self._owners[block.owner]  # type: ignore[arg-type]
            block.owner = None
            block.n_used = 0
        return block

    # -- the BlockPool interface -----------------------------------------------------------------

    @property
    def config(self) -> PoolConfig:
        """The daemon's pool configuration (as of hello; n_blocks is the starting size)."""
        return self._config

    @property
    def streams(self) -> tuple[str, ...]:
        """The pool's streams: ("k", "v") or ("kv",)."""
        return self._streams

    @property
    def stats(self) -> AllocationStats:
        """The daemon's allocator counters, fetched now."""
        with self._lock:
            return stats_from_wire(self._call("stats", {}))

    @property
    def history(self) -> deque[AllocationStats]:
        """The daemon's recent stats snapshots, oldest first, fetched now."""
        with self._lock:
            rows = self._call("history", {})
        return deque((stats_from_wire(r) for r in rows), maxlen=DEFAULT_HISTORY_SIZE)

    def metrics(self) -> str:
        """The daemon's pool counters in the Prometheus text format."""
        with self._lock:
            text: str = self._call("metrics", {})
        return text

    def allocate(
        self,
        stream: str,
        n_tokens: int,
        owner: Owner,
        format: str = "fp16",
        wait: float = 0.0,
        growth: bool = False,
    ) -> list[Block]:
        """Allocate ceil(n_tokens / block_size) blocks to ``owner``, all or nothing.

        With ``wait`` > 0 (seconds, at most MAX_ALLOCATE_WAIT) a request the daemon's budget
        cannot grant now waits there, in its model's fair queue, until it is granted or the
        wait runs out; other threads' calls go on meanwhile (see :meth:`_call_waiting`).
        ``growth`` says the blocks grow a running request: the budget serves it ahead of the
        model's waiting admissions, and lets it wait only while the model is below its fair
        share (docs/protocol.md, "Memory budget").

        Raises:
            ValueError: ``n_tokens`` <= 0, a stream this pool does not have, or ``wait``
                outside 0..MAX_ALLOCATE_WAIT.
            BlockPoolExhaustedError: Too few free blocks (or bytes of the budget), also after
                ``wait``; nothing allocated.
            OverBudgetError: The request can never fit the model's limit or the budget.
            OwnerAlreadyActiveError: Another worker session holds ``owner``.
            ClaimConflictError: ``owner`` was lost in a daemon restart.
        """
        args: dict[str, Any] = {
            "stream": stream,
            "n_tokens": n_tokens,
            "owner": owner,
            "format": format,
        }
        if growth:
            args["growth"] = True

        def adopt(block_ids: list[int]) -> list[Block]:
            return self._blocks_from_ids(block_ids, stream, n_tokens, owner, format)

        if _check_wait(wait) > 0:
            return self._call_waiting("allocate", args, wait, adopt)
        with self._lock:
            self._refuse_lost(owner)
            # A failed allocate leaves no owner registered on the daemon (unlike locally).
            return adopt(self._call("allocate", args))

    def allocate_many(
        self, requests: Sequence[AllocationRequest], wait: float = 0.0, growth: bool = False
    ) -> list[AllocationResult]:
        """Several allocate() calls in one message; per item, its blocks or its exception.

        ``wait`` and ``growth`` as for :meth:`allocate`: the items' bytes are one request to
        the budget.
        """
        items = [AllocationRequest(*request) for request in requests]
        _check_wait(wait)
        with self._lock:
            lost = dict(self._lost)
        sent = [r for r in items if r.owner not in lost] if lost else items
        wire = [[r.stream, r.n_tokens, r.owner, r.format] for r in sent]

        def adopt(replies: list[Any]) -> list[AllocationResult]:
            results: list[AllocationResult] = []
            replies_left = iter(replies)
            for request in items:
                if request.owner in lost:
                    results.append(ClaimConflictError(lost[request.owner]))
                    continue
                reply = next(replies_left)
                if isinstance(reply, list):
                    results.append(
                        self._blocks_from_ids(
                            reply, request.stream, request.n_tokens, request.owner, request.format
                        )
                    )
                else:
                    results.append(error_from_wire(reply["code"], item_message(replies, reply)))
            return results

        if not wire:
            with self._lock:
                return adopt([])
        args: dict[str, Any] = {"items": wire}
        if growth:
            args["growth"] = True
        if wait > 0:
            return self._call_waiting("allocate_many", args, wait, adopt)
        with self._lock:
            return adopt(self._call("allocate_many", args))

    def fit(self, context: int, concurrency: int = 1) -> dict[str, Any]:
        """Whether ``concurrency`` sequences of ``context`` tokens fit this worker's model in
        the daemon's budget: ``{verdict: "now" | "within_reserve" | "after_others_return" |
        "never", need, held, available_now, available_after_return, most_ever, reserve, limit,
        max_concurrency_now, max_concurrency_ever, bytes_per_sequence, budget}`` (bytes; limit
        and budget None when unlimited). See docs/budget.md, "Will it fit?".

        Raises:
            ValueError: ``context`` <= 0 or ``concurrency`` < 1.
        """
        if context < 1 or concurrency < 1:
            raise ValueError(
                f"fit: context and concurrency must be >= 1, got {context} and {concurrency}"
            )
        with self._lock:
            answer: dict[str, Any] = self._call(
                "fit", {"context": context, "concurrency": concurrency}
            )
            return answer

    def free(self, blocks: Iterable[Block]) -> None:
        """Return blocks to the pool; already-free blocks are skipped.

        Raises:
            NotOwnerError: A block is held by another worker session; nothing was freed.
            ClaimConflictError: A block of an owner lost in a daemon restart; nothing was freed.
        """
        blocks = list(blocks)
        with self._lock:
            block_ids = [block.block_id for block in blocks]
            self._refuse_lost_blocks(block_ids)
            self._call("free", {"block_ids": block_ids})
            for block in blocks:
                if self._forget(block.block_id) is not None:
                    block.owner = None
                    block.n_used = 0

    def free_all(self, owner: Owner) -> None:
        """Free every block ``owner`` holds and release the owner id (for an owner lost in a
        daemon restart: forget it, with no call to the daemon).

        Raises:
            NotOwnerError: Another worker session holds ``owner``; nothing was freed.
        """
        with self._lock:
            if self._forget_lost(owner):
                return
            self._call("free_all", {"owner": owner})
            for block_id in list(self._owners.get(owner, ())):
                self._forget(block_id)
            self._owners.pop(owner, None)

    def register_owner(self, owner: Owner) -> None:
        """Mark ``owner`` active for this session.

        Raises:
            OwnerAlreadyActiveError: ``owner`` is active here or in another worker session.
            ClaimConflictError: ``owner`` was lost in a daemon restart (free_all it first).
        """
        with self._lock:
            self._refuse_lost(owner)
            self._call("register_owner", {"owner": owner})
            self._owners.setdefault(owner, {})

    def release_owner(self, owner: Owner) -> None:
        """Release an owner that holds no block (one that holds blocks: use free_all).

        Raises:
            ValueError: ``owner`` still holds blocks.
            NotOwnerError: Another worker session holds ``owner``.
        """
        with self._lock:
            if self._forget_lost(owner):
                return
            self._call("release_owner", {"owner": owner})
            if not self._owners.get(owner, True):  # held with no block: released now
                del self._owners[owner]

    def blocks_for(self, owner: Owner) -> list[Block]:
        """The blocks ``owner`` holds now, in allocation order (the daemon's view).

        Raises:
            NotOwnerError: Another worker session holds ``owner``.
            ClaimConflictError: ``owner`` was lost in a daemon restart.
        """
        with self._lock:
            self._refuse_lost(owner)
            rows = self._call("blocks_for", {"owner": owner})
            blocks: list[Block] = []
            for block_id, stream, fmt, n_used in rows:
                block = self._blocks.get(block_id)
                if block is None:
                    block = Block(block_id, stream, fmt, n_used, owner, True)
                else:
                    block.n_used = n_used
                blocks.append(block)
            return blocks

    def n_free(self, stream: str = "k") -> int:
        """Free blocks left in ``stream``.

        Raises:
            ValueError: A stream this pool does not have.
        """
        with self._lock:
            n: int = self._call("n_free", {"stream": stream})
            return n

    def mark_used(self, block: Block, n_used: int) -> None:
        """Set how many token slots of ``block`` are filled.

        Raises:
            ValueError: ``n_used`` outside 0..block_size.
            NotOwnerError: Another worker session holds the block.
        """
        self.mark_used_many([(block, n_used)])

    def mark_used_many(self, updates: Iterable[tuple[Block, int]]) -> None:
        """mark_used() for several blocks in one message; all checked before any is applied."""
        updates = list(updates)
        block_size = self._config.block_size
        for _, n_used in updates:
            if not 0 <= n_used <= block_size:
                raise ValueError(
                    f"BlockPoolAllocator: n_used must be in 0..{block_size}, got {n_used}"
                )
        with self._lock:
            self._refuse_lost_blocks(b.block_id for b, _ in updates)
            self._call("mark_used", {"updates": [[b.block_id, n] for b, n in updates]})
            for block, n_used in updates:
                block.n_used = n_used
                live = self._blocks.get(block.block_id)
                if live is not None:
                    live.n_used = n_used

    # -- session ---------------------------------------------------------------------------------

    def ping(self) -> None:
        """One round trip to the daemon (it also refreshes the lease)."""
        with self._lock:
            self._call("ping", {})

    def report_load(self, running: int, queued: int, preemptions: int | None = None) -> None:
        """Tell the daemon how many requests this worker runs and queues now (the admin
        ``sessions`` op and ``vqpoolctl watch`` show them), and optionally how many requests it
        has preempted since this client started (a running count, for the reclaim metrics).
        No round trip here: the heartbeat thread sends the counts within LOAD_REPORT_GAP
        seconds, and with every later ping."""
        self._load = (running, queued, preemptions)
        self._heartbeat.wake()

    def set_reclaim_handler(self, handler: ReclaimHandler) -> None:
        """Let the daemon ask this worker to give memory back, with ``handler(n_bytes,
        deadline)`` doing it.

        From now on a thread keeps a ``reclaim_poll`` waiting at the daemon. On an ask it calls
        ``handler`` with the bytes wanted and the monotonic time to be done by; the handler
        frees blocks with :meth:`free` / :meth:`free_all` (from any thread: typically it tells
        the scheduler and waits until its next step boundary has preempted requests), and
        returns. The client then answers the daemon with how far its holdings fell since the
        ask. A handler that raises or frees nothing still gets an answer; one that does not
        return by the deadline is counted late by the daemon, never killed. Calling this
        again replaces the handler. :meth:`close` waits for a handler that is running.

        Raises:
            TypeError: ``handler`` is not callable.
        """
        if not callable(handler):
            raise TypeError(f"reclaim handler must be callable, got {handler!r}")
        if self._reclaim is not None:
            self._reclaim.handler = handler
            return
        self._reclaim = ReclaimListener(self, handler)
        self._reclaim.start()

    def held_bytes(self) -> int:
        """Bytes the blocks this client holds take, by the ``bytes_per_block`` it declared
        (0 if none; no round trip)."""
        cost = self._bytes_per_block
        if cost is None:
            return 0
        blocks = list(self._blocks.values())
        if isinstance(cost, int):
            return cost * len(blocks)
        return sum(cost.get(block.stream, 0) for block in blocks)

    def report_prompt_cache(self, counters: Mapping[str, int]) -> None:
        """Tell the daemon what the worker's prompt cache holds and did (``bytes``, ``blocks``,
        ``entries``, ``lookups``, ``hits``, ``tokens_reused``, ``tokens_prefilled``,
        ``evictions``): sent with the load report (see :meth:`report_load`)."""
        self._prompt_cache = dict(counters)
        self._heartbeat.wake()

    def held_blocks(self) -> Iterator[Block]:
        """The blocks this client holds, as it knows them (no round trip)."""
        return iter(list(self._blocks.values()))

    def close(self) -> None:
        """End the session: the daemon frees whatever this client still holds. Idempotent."""
        if self._closed:
            return
        self._closing.set()
        self._heartbeat.stop()
        if self._reclaim is not None:
            self._reclaim.join()
        with self._lock:
            if self._unusable is None:
                rid = next(self._ids)
                payload = encode_request(rid, "goodbye", {}, self.session_id, self.boot_id)
                # Unanswered: the daemon reaps the session when this process exits.
                with contextlib.suppress(DaemonUnavailableError):
                    self._connection.request(payload, rid, _GOODBYE_TIMEOUT, "goodbye")
            self._closed = True
            self._blocks.clear()
            self._owners.clear()
            self._connection.close()
        self._context.term()

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"PoolClient(run_dir={str(self.run_dir)!r}, name={self.name!r}, "
            f"session={session_label(self.session_id) if self.session_id is not None else None}, "
            f"boot={self.boot_id})"
        )


class _Heartbeat(threading.Thread):
    """Pings the daemon every ``interval`` seconds on a socket of its own, keeping the lease.

    When a reply comes from a new daemon lifetime, it re-syncs the client right away (under the
    client's lock), so an idle worker re-declares its blocks inside the restarted daemon's claim
    period; when the session is gone (evicted), it opens a new one the same way. Stops when the
    client closes. Each ping carries the client's last reported load; a new report wakes the
    thread early.
    """

    def __init__(self, client: PoolClient, interval: float) -> None:
        super().__init__(name=f"vqpool-heartbeat-{client.session_id}", daemon=True)
        self._client = client
        self.interval = interval
        self._stopping = threading.Event()
        self._wake = threading.Event()

    def wake(self) -> None:
        """Ping soon (after LOAD_REPORT_GAP) instead of at the next interval."""
        self._wake.set()

    def _advise(self, advice: dict[str, Any]) -> None:
        handler = self._client.on_advice
        if handler is None:
            return
        try:
            handler(advice)
        except Exception:  # the heartbeat must go on whatever the handler does
            log.exception("following the daemon's advice %r failed", advice)

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self.is_alive():
            self.join()

    def run(self) -> None:
        client = self._client
        connection = LazyPirateConnection(
            client._context, client._endpoint, first_retry=min(0.5, self.interval)
        )
        try:
            while True:
                if self._wake.wait(self.interval):
                    self._stopping.wait(LOAD_REPORT_GAP)  # gather what else changes meanwhile
                if self._stopping.is_set():
                    return
                self._wake.clear()
                session = client._session
                rid = next(client._ids)
                load = client._load
                args: dict[str, Any] = {}
                if load is not None:
                    args = {"running": load[0], "queued": load[1]}
                    if load[2] is not None:
                        args["preemptions"] = max(0, load[2] - client._preemptions_base)
                cached = client._prompt_cache
                if cached is not None and not client._prompt_cache_refused:
                    args["prompt_cache"] = cached
                payload = encode_request(rid, "ping", args, *session)
                try:
                    reply = connection.request(payload, rid, self.interval, "heartbeat")
                except DaemonUnavailableError:
                    client._daemon_silent = True  # /health says so (session_problem)
                    continue  # keep trying: a busy or restarting daemon may answer the next one
                client._daemon_silent = False
                if reply.get("boot") != session[1] or client._claims_due:
                    try:
                        client.resync_from_heartbeat(reply.get("boot"))
                    except ValueError as exc:
                        # The new daemon refused this session (e.g. a budget now wants bytes per
                        # block): callers get the refusal; keep beating for the next try.
                        log.error("re-sync with the restarted vqpoold refused: %s", exc)
                elif not reply["ok"] and reply["error"]["code"] == ErrorCode.NO_SESSION:
                    client.reopen_from_heartbeat(session)  # evicted while alive
                elif not reply["ok"] and "'prompt_cache'" in reply["error"]["message"]:
                    client._prompt_cache_refused = True  # a daemon older than the argument
                    self._wake.set()  # send the load alone at once
                else:
                    if reply["ok"] and isinstance(reply.get("result"), dict):
                        self._advise(reply["result"])
                    if client._abandoned:
                        client.settle_from_heartbeat()  # the daemon answers again
        finally:
            connection.close()
