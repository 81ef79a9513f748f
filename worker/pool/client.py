"""PoolClient: the daemon's block pool, seen from one worker process.

A :class:`PoolClient` has the methods, signatures, return types and exceptions of the local
:class:`~vqpool.shared.allocator.BlockPoolAllocator` (it satisfies
:class:`~vqpool.shared.pool.BlockPool`), so a pooled KV cache runs unchanged on either. Each
call is one request to ``vqpoold``; the caller sees a daemon restart or an eviction as nothing
but a slower call (or ClaimConflictError for an owner lost on the way). The client is made of
parts with one job each:

* :mod:`~vqpool.worker.pool.session`: the sockets, request ids and session; a call waits for
  its reply a bounded time and resends the same request id on silence (Lazy Pirate), so a lost
  reply costs a resend, never a leaked or doubled allocation. Calls from several threads are
  serialized on one lock: each call's request and the bookkeeping it implies happen in daemon
  order.
* :mod:`~vqpool.worker.pool.calls`: a call's rules: its deadline, RETRY_LATER retries, and a
  re-sync or re-open when the daemon refuses it for a restart or an ended session; the
  allocations that wait at the daemon.
* :mod:`~vqpool.worker.pool.resync`: daemon restarts (re-sync: claim back every owner held)
  and evictions (open a new session). See docs/reliability.md.
* :mod:`~vqpool.worker.pool.holdings` and :mod:`~vqpool.worker.pool.lost_owners`: the blocks
  and owners held, and the owners lost in a restart conflict or an eviction.
* :mod:`~vqpool.worker.pool.heartbeat`: a thread keeping the lease, carrying load reports.
* :mod:`~vqpool.worker.pool.abandoned`: waiting allocations given up on, settled later.
* :mod:`~vqpool.worker.pool.deferred`: frees (and fill updates) made while the daemon does not
  answer, sent once it does: a request ending while vqpoold is down does not wait for it.
* :mod:`~vqpool.worker.pool.reclaim_listener`: the daemon's asks to give memory back.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from vqpool.shared.allocator import (
    DEFAULT_HISTORY_SIZE,
    AllocationStats,
    Block,
    Owner,
    PoolConfig,
)
from vqpool.shared.config import resolve_run_dir
from vqpool.shared.errors import ClaimConflictError, error_from_wire
from vqpool.shared.kv_sequence import SequenceQuantization
from vqpool.shared.pool import AllocationRequest, AllocationResult
from vqpool.shared.protocol import item_message, session_label, stats_from_wire
from vqpool.shared.transport import FIRST_RETRY_SECONDS
from vqpool.worker.pool.calls import DaemonCalls
from vqpool.worker.pool.heartbeat import Heartbeat, LoadReport
from vqpool.worker.pool.holdings import Holdings
from vqpool.worker.pool.lost_owners import LostOwners
from vqpool.worker.pool.reclaim_listener import ReclaimHandler, ReclaimListener
from vqpool.worker.pool.resync import SessionResync
from vqpool.worker.pool.session import DaemonSession

DEFAULT_TIMEOUT = 10.0
"""Seconds a call may take, retries included, before DaemonUnavailableError."""

MAX_ALLOCATE_WAIT = 60.0
"""The longest ``wait`` an allocation may ask the daemon for (the protocol's bound)."""


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
        weights: Bytes of the model's weights as loaded, charged to this session in the
            daemon's budget (None: not declared).
        bytes_per_format: Bytes one block of each format holds in this worker (tag -> int or
            map stream -> int, tags of :mod:`vqpool.shared.kv_formats`): the daemon charges
            each block its format's bytes; None: every block costs ``bytes_per_block``.
        overhead: Bytes the worker may hold beyond its weights and KV blocks (its MLX
            buffer-cache limit), charged with its weights (None: not declared).
        quantization: With a quantized format in ``bytes_per_format``: how this worker holds
            a sequence's blocks (``--quantized-kv-start``, first-pass slots), which the
            daemon's ``fit`` prices a sequence with (None: start 0, no first-pass slots).
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
        weights: int | None = None,
        bytes_per_format: Mapping[str, int | Mapping[str, int]] | None = None,
        overhead: int | None = None,
        quantization: SequenceQuantization | None = None,
    ) -> None:
        self._session = DaemonSession(
            resolve_run_dir(run_dir),
            name=name,
            bytes_per_block=bytes_per_block,
            timeout=timeout,
            first_retry=first_retry,
            weights=weights,
            bytes_per_format=bytes_per_format,
            overhead=overhead,
            quantization=quantization,
        )
        self._lock = self._session.lock
        self._connection = self._session.connection  # the caller's socket (its resend count)
        self._holdings = Holdings()
        self._lost = LostOwners()
        self._report = LoadReport()
        self._resync = SessionResync(
            self._session, self._holdings, self._lost, on_open=self._report.session_opened
        )
        self._calls = DaemonCalls(self._session, self._holdings, self._resync, self._lost)
        self._reclaim: ReclaimListener | None = None
        self._heartbeat = Heartbeat(self._session, self._report, self._calls)
        self._heartbeat.start()
        if on_reclaim is not None:
            self.set_reclaim_handler(on_reclaim)

    @property
    def run_dir(self) -> Path:
        return self._session.run_dir

    @property
    def name(self) -> str:
        return self._session.name

    @property
    def timeout(self) -> float:
        return self._session.timeout

    @property
    def session_id(self) -> int | None:
        """The daemon's id of this session (None while a new one is being opened)."""
        return self._session.session_id

    @property
    def boot_id(self) -> str | None:
        """The daemon lifetime this session belongs to."""
        return self._session.boot_id

    @property
    def lease(self) -> float:
        """Seconds the daemon keeps this session without a request or ping."""
        return self._session.lease

    @property
    def resyncs(self) -> list[dict[str, Any]]:
        """One record per re-sync: ``{boot, seconds, owners_claimed, owners_refused,
        blocks_claimed}``."""
        return self._resync.records

    @property
    def on_advice(self) -> Callable[[dict[str, Any]], None] | None:
        """Called (on the heartbeat thread, no lock held) with what the daemon's answer to a
        load report asks of this worker: ``{drop_cache: true}`` or ``{release_bytes: n}``;
        None: nothing is done."""
        return self._heartbeat.on_advice

    @on_advice.setter
    def on_advice(self, handler: Callable[[dict[str, Any]], None] | None) -> None:
        self._heartbeat.on_advice = handler

    def session_problem(self) -> str | None:
        """Why this client cannot use a pool session right now, or None when it can: the
        daemon ended it and a new one is not open yet, the daemon did not answer the last
        heartbeat (stopped, or restarting), or a restarted daemon has not taken back all the
        blocks held here yet. No round trip: what the heartbeat and the calls last saw."""
        if self._resync.unusable is not None:
            return self._resync.unusable
        if self.session_id is None:
            return "no pool session (evicted?); opening a new one"
        down = self.daemon_unavailable()
        if down is not None:
            return f"{down}; the session resumes when it is back"
        if self._resync.claims_due:
            return "re-declaring the blocks held here to a restarted vqpoold"
        return None

    @property
    def calls_kept(self) -> int:
        """Frees (and fill updates) kept while the daemon did not answer, not sent yet: the
        heartbeat sends them once it answers again."""
        return self._calls.n_kept

    def daemon_unavailable(self) -> str | None:
        """Why nothing new can start now, in one line naming the daemon, when the heartbeat
        found it silent (its last ping went unanswered); None while it answers. No round trip:
        a caller refuses new work at once with it instead of waiting out a call's timeout."""
        heartbeat = self._heartbeat
        if not heartbeat.daemon_silent:
            return None
        run_dir = self._session.run_dir
        if heartbeat.daemon_listening is False:
            return (
                f"vqpoold is not running on {run_dir}; start it with `vqpoold --run-dir {run_dir}`"
            )
        return (
            f"vqpoold does not answer on {run_dir} (stopped, busy or restarting); if it is not "
            f"running, start it with `vqpoold --run-dir {run_dir}`"
        )

    def lost_owners(self) -> dict[Owner, str]:
        """Owners lost in a daemon restart (their claim was refused), with the reason."""
        with self._lock:
            return self._lost.reasons()

    def _call_locked(self, op: str, args: Mapping[str, Any]) -> Any:
        with self._lock:
            return self._calls.call(op, args)

    # -- the BlockPool interface -----------------------------------------------------------------

    @property
    def config(self) -> PoolConfig:
        """The daemon's pool configuration (as of hello; n_blocks is the starting size)."""
        return self._session.config

    @property
    def streams(self) -> tuple[str, ...]:
        """The pool's streams: ("k", "v") or ("kv",)."""
        return self._session.streams

    @property
    def stats(self) -> AllocationStats:
        """The daemon's allocator counters, fetched now."""
        with self._lock:
            return stats_from_wire(self._calls.call("stats", {}))

    @property
    def history(self) -> deque[AllocationStats]:
        """The daemon's recent stats snapshots, oldest first, fetched now."""
        with self._lock:
            rows = self._calls.call("history", {})
        return deque((stats_from_wire(r) for r in rows), maxlen=DEFAULT_HISTORY_SIZE)

    def metrics(self) -> str:
        """The daemon's pool counters in the Prometheus text format."""
        with self._lock:
            text: str = self._calls.call("metrics", {})
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
        wait runs out; other threads' calls go on meanwhile (see
        :meth:`~vqpool.worker.pool.calls.DaemonCalls.call_waiting`).
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
            return self._holdings.add(block_ids, stream, n_tokens, owner, format, self.config)

        if _check_wait(wait) > 0:
            return self._calls.call_waiting("allocate", args, wait, adopt)
        with self._lock:
            self._lost.refuse(owner)
            # A failed allocate leaves no owner registered on the daemon (unlike locally).
            return adopt(self._calls.call("allocate", args))

    def cancellable(self, event: threading.Event) -> AbstractContextManager[None]:
        """Let another thread give up this thread's waiting allocations (``wait`` > 0) made
        inside the block, by setting ``event``: one parked at the daemon is cancelled there
        (the ``cancel`` op: it leaves its model's queue at once), one not sent yet is not sent.
        The allocation then raises RequestCancelledError, or returns the blocks the daemon
        granted before the cancel (the caller frees them)."""
        return self._calls.cancellable(event)

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
            lost = self._lost.reasons()
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
                        self._holdings.add(
                            reply,
                            request.stream,
                            request.n_tokens,
                            request.owner,
                            request.format,
                            self.config,
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
            return self._calls.call_waiting("allocate_many", args, wait, adopt)
        with self._lock:
            return adopt(self._calls.call("allocate_many", args))

    def fit(self, context: int, concurrency: int = 1) -> dict[str, Any]:
        """Whether ``concurrency`` sequences of ``context`` tokens fit this worker's model in
        the daemon's budget: ``{verdict: "now" | "within_reserve" | "after_others_return" |
        "never", need, held, available_now, available_after_return, most_ever, reserve, limit,
        max_concurrency_now, max_concurrency_ever, own_cache_now, bytes_per_sequence, budget}``
        (bytes; limit and budget None when unlimited; available_now counts the model's own idle
        prompt cache, own_cache_now says how much). See docs/budget.md, "Will it fit?".

        Raises:
            ValueError: ``context`` <= 0 or ``concurrency`` < 1.
        """
        if context < 1 or concurrency < 1:
            raise ValueError(
                f"fit: context and concurrency must be >= 1, got {context} and {concurrency}"
            )
        with self._lock:
            answer: dict[str, Any] = self._calls.call(
                "fit", {"context": context, "concurrency": concurrency}
            )
            return answer

    def free(self, blocks: Iterable[Block]) -> None:
        """Return blocks to the pool; already-free blocks are skipped. While vqpoold does not
        answer, the call is kept and sent once it does (the blocks are forgotten here at once).

        Raises:
            NotOwnerError: A block is held by another worker session; nothing was freed.
            ClaimConflictError: A block of an owner lost in a daemon restart; nothing was freed.
        """
        blocks = list(blocks)
        with self._lock:
            block_ids = [block.block_id for block in blocks]
            self._lost.refuse_blocks(block_ids)
            self._give_back("free", {"block_ids": block_ids})
            for block in blocks:
                if self._holdings.forget(block.block_id) is not None:
                    block.owner = None
                    block.n_used = 0

    def free_all(self, owner: Owner) -> None:
        """Free every block ``owner`` holds and release the owner id (for an owner lost in a
        daemon restart: forget it, with no call to the daemon). While vqpoold does not answer,
        the call is kept and sent once it does; a restarted daemon never gets the owner back.

        Raises:
            NotOwnerError: Another worker session holds ``owner``; nothing was freed.
        """
        with self._lock:
            if self._lost.forget(owner):
                return
            self._give_back("free_all", {"owner": owner})
            for block_id in list(self._holdings.owners.get(owner, ())):
                self._holdings.forget(block_id)
            self._holdings.owners.pop(owner, None)

    def register_owner(self, owner: Owner) -> None:
        """Mark ``owner`` active for this session.

        Raises:
            OwnerAlreadyActiveError: ``owner`` is active here or in another worker session.
            ClaimConflictError: ``owner`` was lost in a daemon restart (free_all it first).
        """
        with self._lock:
            self._lost.refuse(owner)
            self._calls.call("register_owner", {"owner": owner})
            self._holdings.owners.setdefault(owner, {})

    def release_owner(self, owner: Owner) -> None:
        """Release an owner that holds no block (one that holds blocks: use free_all).

        Raises:
            ValueError: ``owner`` still holds blocks.
            NotOwnerError: Another worker session holds ``owner``.
        """
        with self._lock:
            if self._lost.forget(owner):
                return
            self._give_back("release_owner", {"owner": owner})
            if not self._holdings.owners.get(owner, True):  # held with no block: released now
                del self._holdings.owners[owner]

    def blocks_for(self, owner: Owner) -> list[Block]:
        """The blocks ``owner`` holds now, in allocation order (the daemon's view).

        Raises:
            NotOwnerError: Another worker session holds ``owner``.
            ClaimConflictError: ``owner`` was lost in a daemon restart.
        """
        with self._lock:
            self._lost.refuse(owner)
            rows = self._calls.call("blocks_for", {"owner": owner})
            blocks: list[Block] = []
            for block_id, stream, fmt, n_used in rows:
                block = self._holdings.blocks.get(block_id)
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
            n: int = self._calls.call("n_free", {"stream": stream})
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
        block_size = self.config.block_size
        for _, n_used in updates:
            if not 0 <= n_used <= block_size:
                raise ValueError(
                    f"BlockPoolAllocator: n_used must be in 0..{block_size}, got {n_used}"
                )
        with self._lock:
            self._lost.refuse_blocks(b.block_id for b, _ in updates)
            self._give_back("mark_used", {"updates": [[b.block_id, n] for b, n in updates]})
            for block, n_used in updates:
                block.n_used = n_used
                live = self._holdings.blocks.get(block.block_id)
                if live is not None:
                    live.n_used = n_used

    def _give_back(self, op: str, args: dict[str, Any]) -> None:
        """free, free_all, release_owner or mark_used: sent, or, while the daemon does not
        answer, kept and sent once it does (:mod:`~vqpool.worker.pool.deferred`); the caller
        holds the lock and updates what it holds either way."""
        self._calls.call_or_keep(op, args, self._heartbeat.daemon_silent)

    # -- session ---------------------------------------------------------------------------------

    def ping(self) -> None:
        """One round trip to the daemon (it also refreshes the lease)."""
        with self._lock:
            self._calls.call("ping", {})

    def report_load(self, running: int, queued: int, preemptions: int | None = None) -> None:
        """Tell the daemon how many requests this worker runs and queues now (the admin
        ``sessions`` op and ``vqpoolctl watch`` show them), and optionally how many requests it
        has preempted since this client started (a running count, for the reclaim metrics).
        No round trip here: the heartbeat thread sends the counts within LOAD_REPORT_GAP
        seconds, and with every later ping."""
        self._report.load = (running, queued, preemptions)
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
        self._reclaim = ReclaimListener(
            self._session, handler, held_bytes=self.held_bytes, call=self._call_locked
        )
        self._reclaim.start()

    def held_bytes(self) -> int:
        """Bytes the blocks this client holds take, by the ``bytes_per_block`` and
        ``bytes_per_format`` it declared (0 if none; no round trip)."""
        session = self._session
        return self._holdings.held_bytes(session.bytes_per_block, session.bytes_per_format)

    def report_prompt_cache(self, counters: Mapping[str, int]) -> None:
        """Tell the daemon what the worker's prompt cache holds and did (``bytes``, ``blocks``,
        ``entries``, ``lookups``, ``hits``, ``tokens_reused``, ``tokens_prefilled``,
        ``evictions``): sent with the load report (see :meth:`report_load`)."""
        self._report.prompt_cache = dict(counters)
        self._heartbeat.wake()

    def report_memory(self, probe: Callable[[], dict[str, int]]) -> None:
        """Send ``probe()`` (the process's memory: ``weights``, ``mlx_active``, ``mlx_cache``,
        ``mlx_peak``, ``rss`` in bytes) with every load report, sampled at most once per
        heartbeat interval, from the heartbeat's thread."""
        self._report.memory_interval = self._session.heartbeat
        self._report.memory_probe = probe
        self._heartbeat.wake()

    def held_blocks(self) -> Iterator[Block]:
        """The blocks this client holds, as it knows them (no round trip)."""
        return self._holdings.held_blocks()

    def close(self) -> None:
        """End the session: the daemon frees whatever this client still holds. Idempotent."""
        session = self._session
        if session.closed:
            return
        session.closing.set()
        self._heartbeat.stop()
        if self._reclaim is not None:
            self._reclaim.join()
        with self._lock:
            if self._resync.unusable is None:
                session.goodbye()
            session.closed = True
            self._holdings.clear()
            session.connection.close()
        session.context.term()

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
