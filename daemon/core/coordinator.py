"""The daemon's state and its ownership rules: one allocator shared by every worker session.

The allocator knows owners; this layer knows which session each owner belongs to, and enforces
what the allocator alone cannot: an owner id is held by one session at a time, and a session may
only touch the blocks and owners it holds. Every check of a request runs before any change, so a
refused request leaves no trace.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from itertools import compress, repeat
from operator import is_, itemgetter
from pathlib import Path
from typing import Any, NamedTuple, cast

from vqpool.daemon.core.claims import ClaimPeriod, read_roll, write_roll
from vqpool.daemon.core.replies import ReplyCache
from vqpool.daemon.core.sessions import Session, SessionTable
from vqpool.daemon.core.timeline import HistoryClock, StreamTimeline
from vqpool.shared.allocator import Block, BlockPoolAllocator, Owner, PoolConfig
from vqpool.shared.errors import (
    BlockPoolExhaustedError,
    ClaimConflictError,
    NotOwnerError,
    OwnerAlreadyActiveError,
    VqpoolError,
)
from vqpool.shared.protocol import (
    MAX_BLOCKS_PER_ALLOCATE,
    MAX_BLOCKS_PER_REQUEST,
    ClaimGroup,
    ItemErrors,
)

log = logging.getLogger("vqpoold")

ID_SHORTAGE_SECONDS = 5.0
"""How long an allocation refused for lack of ids is remembered (:meth:`Coordinator.ids_short`).
A worker whose request waits for blocks retries every few tens of milliseconds, renewing it; one
that gave up stops asking other workers' prompt caches for blocks within these seconds."""

BlockCounts = dict[str, int]
"""Blocks per stream."""

FormatCounts = dict[tuple[str, str], int]
"""Blocks per (stream, format): what a free, a claim or a session's end changed, for the budget
above to price (the coordinator knows blocks, never bytes)."""


ClaimAdmission = Callable[[Session, Owner, FormatCounts], Callable[[], None]]
"""The budget's check of one owner's claim (blocks per (stream, format) as the claim names
them), called
before its blocks are taken: raises to refuse it, else has charged it and returns the undo,
called if the blocks are not taken after all."""


_N_TOKENS_OF = itemgetter(1)
_OWNER_OF = itemgetter(2)
"""The n_tokens and owner of an allocate_many item (stream, n_tokens, owner, format)."""


class SessionEnd(NamedTuple):
    """What ending a session freed: owners released, blocks freed, and those blocks per (stream,
    format) (counted only when asked)."""

    n_owners: int
    n_blocks: int
    counts: FormatCounts


def new_boot_id() -> str:
    """A random id for one daemon lifetime."""
    return secrets.token_hex(8)


class Coordinator:
    """The allocator, the sessions, and who holds what.

    Attributes:
        allocator: The one pool every worker draws from.
        sessions: Live worker sessions.
        replies: Recent replies to mutating requests of every session, for resends.
        boot_id: Random id of this daemon lifetime, stamped on every reply; a client that sees
            it change knows its blocks belong to a previous lifetime.
        lease: Seconds a stopped worker keeps its blocks after it was last heard from.
        run_dir: Where the sockets live (for the admin's eyes).
        timeline: Blocks in use per stream over time, sampled by the server loop.
        history_clock: The times of the allocator's history rows, stamped by the server loop.
        claim_period: The claim period of this start (see ``daemon/core/claims.py``), or None when
            no worker of a previous daemon was alive at start.
        claiming: ``claim_period`` while it runs (allocations are refused), then None: the one
            attribute the request hot path looks at.

    The memory budget sits above this layer (``daemon/budget/``): it calls the methods that
    change holdings, and prices what they return (blocks per stream) in bytes.
    """

    def __init__(
        self,
        config: PoolConfig,
        *,
        lease: float,
        run_dir: Path,
        claim_grace: float = 0.0,
        boot_id: str | None = None,
    ) -> None:
        self.allocator = BlockPoolAllocator(config)
        self.sessions = SessionTable()
        self.replies = ReplyCache()
        self.boot_id = boot_id or new_boot_id()
        self.lease = lease
        self.claim_grace = claim_grace
        self.run_dir = run_dir
        self.pid = os.getpid()
        self.started = time.time()
        self.started_monotonic = time.monotonic()
        self.timeline = StreamTimeline(self.allocator.streams)
        self.history_clock = HistoryClock()
        self._holder: dict[Owner, Session] = {}
        self._max_tokens = MAX_BLOCKS_PER_ALLOCATE * config.block_size
        # Per pool stream, the blocks of the latest allocation refused for lack of free ids and
        # when (monotonic): one record a stream, whatever the number of waiting requests.
        self._id_shortages: dict[str, tuple[int, float]] = {}
        self._one_stream = None if config.separate_kv else "kv"
        # Counters for the admin's stats; plain ints so the hot path pays one add.
        self.n_requests = 0
        self.n_bad_requests = 0
        self.n_replies_dropped = 0
        self.n_sessions_opened = 0
        self.n_sessions_reaped = 0
        self.n_sessions_evicted = 0
        self.n_owners_claimed = 0
        self.n_owners_refused = 0
        self.n_blocks_claimed = 0
        expected = read_roll(run_dir) if claim_grace > 0 else {}
        self.claim_period: ClaimPeriod | None = None
        if expected:
            self.claim_period = ClaimPeriod(expected, claim_grace, self.started_monotonic)
            log.info(
                "%d session(s) of the previous daemon's workers are alive (pids %s): taking "
                "their claims for up to %gs before serving allocations",
                len(expected),
                sorted({pid for pid, _ in expected}),
                claim_grace,
            )
        self.claiming: ClaimPeriod | None = self.claim_period
        self._roll_dirty = False
        self.write_roll()

    # -- owners ------------------------------------------------------------------------------------

    def holder_of(self, owner: Owner) -> Session | None:
        """The session holding ``owner``, or None if no session does."""
        return self._holder.get(owner)

    def _bind(self, owner: Owner, session: Session) -> None:
        self._holder[owner] = session
        session.owners.add(owner)

    def _unbind(self, owner: Owner) -> None:
        session = self._holder.pop(owner, None)
        if session is not None:
            session.owners.discard(owner)

    @staticmethod
    def _owner_taken(owner: Owner, holder: Session) -> OwnerAlreadyActiveError:
        return OwnerAlreadyActiveError(
            f"owner {owner!r} is active in another worker session (pid {holder.pid}, "
            f"model {holder.model!r}); owner ids are global across workers: use another id"
        )

    def _require_held(self, session: Session, owner: Owner, what: str) -> Session | None:
        """The holder of ``owner`` if it is ``session`` or nobody; NotOwnerError otherwise."""
        holder = self._holder.get(owner)
        if holder is not None and holder is not session:
            raise NotOwnerError(
                f"{what}: owner {owner!r} belongs to another worker session (pid {holder.pid}); "
                "nothing was changed"
            )
        return holder

    # -- worker ops --------------------------------------------------------------------------------

    def allocate(
        self, session: Session, stream: str, n_tokens: int, owner: Owner, fmt: str
    ) -> list[int]:
        """allocate() for ``session``: the new blocks' ids (their stream and fill are implied).
        All or nothing whatever is raised: a failed allocation (an exhausted pool included,
        unlike the local allocator) leaves no owner bound or registered that was not before."""
        # check_allocate() and _bind(), inlined for the common case
        holder = self._holder.get(owner)
        if (holder is not session and holder is not None) or n_tokens > self._max_tokens:
            self.check_allocate(session, n_tokens, owner)  # raises what is wrong
        try:
            if holder is not None:  # already ours: the allocator alone decides
                ids = self.allocator.allocate_ids(stream, n_tokens, owner, fmt)
            else:
                try:
                    self._holder[owner] = session
                    session.owners.add(owner)
                    ids = self.allocator.allocate_ids(stream, n_tokens, owner, fmt)
                except BaseException:
                    # An exhausted allocate registers the owner (seed behaviour); it held
                    # nothing before.
                    self.allocator.release_owner(owner)
                    self._unbind(owner)
                    raise
        except BlockPoolExhaustedError:
            # NOTE: a refusal for lack of ids is never parked (the budget parks byte waits
            # only), so it is recorded here for the cache advice to ask prompt caches for ids.
            self._note_id_shortage(stream, n_tokens)
            raise
        if self._id_shortages:  # one test on the hot path while no allocation is short
            self._note_ids_served(self._one_stream or stream, len(ids))
        return list(ids)

    def check_allocate(self, session: Session, n_tokens: int, owner: Owner) -> Session | None:
        """The checks of an allocate that need no pool: the owner is free or ``session``'s (its
        holder is returned) and ``n_tokens`` within one allocation. The budget asks them before
        its ledger, so such a request is refused as what it is, never parked.

        Raises:
            OwnerAlreadyActiveError: Another session holds ``owner``.
            ValueError: ``n_tokens`` needs more than MAX_BLOCKS_PER_ALLOCATE blocks.
        """
        holder = self._holder.get(owner)
        if holder is not session and holder is not None:
            raise self._owner_taken(owner, holder)
        if n_tokens > self._max_tokens:
            raise ValueError(
                f"allocate: n_tokens {n_tokens} needs more than {MAX_BLOCKS_PER_ALLOCATE} blocks; "
                "allocate in steps"
            )
        return holder

    def _note_id_shortage(self, stream: str, n_tokens: int) -> None:
        """An allocation of ``n_tokens`` in ``stream`` was refused for lack of ids."""
        self._id_shortages[self._one_stream or stream] = (
            -(-n_tokens // self.allocator.config.block_size),
            time.monotonic(),
        )

    def _note_ids_served(self, stream: str, n_blocks: int) -> None:
        """An allocation of ``n_blocks`` in ``stream`` was served: as many as a recorded
        shortage asked were free, so it is over (a request still short records it again)."""
        shortage = self._id_shortages.get(stream)
        if shortage is not None and n_blocks >= shortage[0]:
            del self._id_shortages[stream]

    def ids_short(self, now: float) -> BlockCounts:
        """Blocks per stream that allocations refused for lack of ids in the last
        :data:`ID_SHORTAGE_SECONDS` (monotonic ``now``) lack beyond the free ones now; records
        older than that are dropped."""
        short: BlockCounts = {}
        for stream, (n_blocks, when) in list(self._id_shortages.items()):
            if now - when > ID_SHORTAGE_SECONDS:
                del self._id_shortages[stream]
            elif (lacking := n_blocks - self.allocator.n_free(stream)) > 0:
                short[stream] = lacking
        return short

    def allocate_many(
        self, session: Session, items: Sequence[tuple[str, int, Owner, str]]
    ) -> list[list[int] | dict[str, Any]]:
        """allocate() per item; each result is the block ids or an error entry (see
        :class:`~vqpool.shared.protocol.ItemErrors`). Items fail on their own; anything else
        raised undoes the whole request.

        Raises:
            ValueError: The items ask for more than MAX_BLOCKS_PER_REQUEST blocks in all.
        """
        block_size = self.allocator.config.block_size
        holder = self._holder
        max_tokens = self._max_tokens
        # The item columns the checks read, and each owner's holder, made in C (no per-item
        # Python code while every item is well within the bounds, the common batch).
        tokens = list(map(_N_TOKENS_OF, items))
        owners = list(map(_OWNER_OF, items))
        held = list(map(holder.get, owners))
        largest = max(tokens, default=0)
        # Blocks asked in all: counted only when every item as large as the largest could
        # exceed the bound.
        if len(items) * -(-largest // block_size) > MAX_BLOCKS_PER_REQUEST:
            n_blocks = sum(-(-n // block_size) for n in tokens if n > 0)
            if n_blocks > MAX_BLOCKS_PER_REQUEST:
                raise ValueError(
                    f"allocate_many: the items ask for {n_blocks} blocks in all; at most "
                    f"{MAX_BLOCKS_PER_REQUEST} per request: send several"
                )
        # Owners bound to no session (bound once allocated for), and the checks that need no
        # pool (check_allocate()) of items that may fail them: such an item never reaches the
        # allocator. Another session's owner cannot change hands meanwhile.
        unbound: set[Owner] = set(compress(owners, map(is_, held, repeat(None))))
        errors = ItemErrors()
        refused: dict[int, dict[str, Any]] = {}  # item index: its error entry
        if largest > max_tokens or held.count(None) + held.count(session) != len(held):
            for index, (held_by, n, owner) in enumerate(zip(held, tokens, owners, strict=True)):
                if (held_by is not session and held_by is not None) or n > max_tokens:
                    try:
                        self.check_allocate(session, n, owner)
                    except (ValueError, VqpoolError) as exc:
                        refused[index] = errors.entry(index, exc)
        asked = items
        if refused:
            asked = [item for index, item in enumerate(items) if index not in refused]
        got: list[tuple[int, ...] | ValueError | VqpoolError] = []
        try:
            n_failed = self.allocator.allocate_ids_each(asked, got, unbound)
        except BaseException:
            done = [
                (item[2], ids) for item, ids in zip(asked, got, strict=False) if type(ids) is tuple
            ]
            self._undo_allocations(
                done, [o for o in dict.fromkeys(o for o, _ in done) if o in unbound]
            )
            raise
        if not refused and not n_failed:  # every item allocated: every unbound owner is bound
            if unbound:
                holder.update(dict.fromkeys(unbound, session))
                session.owners.update(unbound)
            allocated = cast("list[tuple[int, ...]]", got)
            if self._id_shortages:
                for (stream, _, _, _), ids in zip(items, allocated, strict=True):
                    self._note_ids_served(self._one_stream or stream, len(ids))
            return list(map(list, allocated))
        # Bind what was allocated for (_bind(), inlined), and note shortages, as the items came.
        add_owner = session.owners.add
        results: list[list[int] | dict[str, Any]] = []
        outcomes = iter(got)
        for index, (stream, n_tokens, owner, _) in enumerate(items):
            if refused and index in refused:
                results.append(refused[index])
                continue
            outcome = next(outcomes)
            if isinstance(outcome, tuple):
                if owner in unbound and owner not in holder:
                    holder[owner] = session
                    add_owner(owner)
                if self._id_shortages:
                    self._note_ids_served(self._one_stream or stream, len(outcome))
                results.append(list(outcome))
                continue
            if isinstance(outcome, BlockPoolExhaustedError):
                self._note_id_shortage(stream, n_tokens)
            results.append(errors.entry(index, outcome))
        return results

    def _undo_allocations(
        self, done: list[tuple[Owner, tuple[int, ...]]], bound: list[Owner]
    ) -> None:
        """Free what an interrupted allocate_many allocated, unbind the owners it bound, and
        keep registered the owners the session held before (freeing their last block released
        them)."""
        allocator = self.allocator
        for _, ids in reversed(done):
            allocator.free_ids(ids)
        for owner in bound:
            allocator.release_owner(owner)
            self._unbind(owner)
        for owner in {owner for owner, _ in done}.difference(bound):
            if not allocator.is_active(owner):
                allocator.register_owner(owner)

    def free(self, session: Session, block_ids: Sequence[int], counted: bool) -> FormatCounts:
        """Free blocks by id. Free ids are skipped (as the allocator does); one id held by
        another session refuses the whole request.

        Returns:
            With ``counted``, the blocks freed per (stream, format) (each id once); else {}:
            counting costs a lookup per block, paid only when the caller prices them.
        """
        allocator = self.allocator
        owner_of = allocator.owner_of
        holder = self._holder
        touched: set[Owner] = set()
        freed: FormatCounts = {}
        for block_id in dict.fromkeys(block_ids) if counted else block_ids:
            owner = owner_of(block_id)
            if owner is None:
                continue
            if holder.get(owner) is not session:
                raise NotOwnerError(
                    f"free: block {block_id} is held by another worker session; nothing was freed"
                )
            touched.add(owner)
            if counted:
                kind = allocator.stream_format_of(block_id) or ("", "")
                freed[kind] = freed.get(kind, 0) + 1
        allocator.free_ids(block_ids)
        for owner in touched:
            if not allocator.is_active(owner):
                self._unbind(owner)
        return freed

    def free_all(self, session: Session, owner: Owner, counted: bool) -> FormatCounts:
        """free_all() of an owner this session holds (an unknown owner is a no-op); with
        ``counted``, the blocks freed per (stream, format) (else {})."""
        self._require_held(session, owner, "free_all")
        freed = self.allocator.format_usage(owner) if counted else {}
        self.allocator.free_all(owner)
        self._unbind(owner)
        return freed

    def register_owner(self, session: Session, owner: Owner) -> None:
        """register_owner(): the owner becomes this session's."""
        holder = self._holder.get(owner)
        if holder is not None and holder is not session:
            raise self._owner_taken(owner, holder)
        self.allocator.register_owner(owner)
        self._bind(owner, session)

    def release_owner(self, session: Session, owner: Owner) -> None:
        """release_owner() of an owner this session holds that holds no block.

        Unlike the local allocator, an owner that still holds blocks is refused: releasing it
        would let another worker take an id whose blocks are still in use here.
        """
        if self._require_held(session, owner, "release_owner") is None:
            return
        n_held = self.allocator.n_blocks_for(owner)
        if n_held:
            raise ValueError(
                f"release_owner: owner {owner!r} still holds {n_held} block(s); free them or "
                "call free_all(owner)"
            )
        self.allocator.release_owner(owner)
        self._unbind(owner)

    def blocks_for(self, session: Session, owner: Owner) -> list[Block]:
        """blocks_for() of an owner this session holds (an unknown owner has none)."""
        if self._require_held(session, owner, "blocks_for") is None:
            return []
        return self.allocator.blocks_for(owner)

    def mark_used(self, session: Session, updates: Sequence[tuple[int, int]]) -> None:
        """mark_used() for several blocks, all checked before any is applied."""
        allocator = self.allocator
        block_size = allocator.config.block_size
        for _, n_used in updates:
            if not 0 <= n_used <= block_size:
                raise ValueError(
                    f"BlockPoolAllocator: n_used must be in 0..{block_size}, got {n_used}"
                )
        holder = self._holder
        for block_id, _ in updates:
            owner = allocator.owner_of(block_id)
            if owner is not None and holder.get(owner) is not session:
                raise NotOwnerError(
                    f"mark_used: block {block_id} is held by another worker session; "
                    "nothing was changed"
                )
        allocator.mark_used_many([(Block(block_id), n_used) for block_id, n_used in updates])

    # -- restart claims ----------------------------------------------------------------------------

    def claim(
        self,
        session: Session,
        owners: Sequence[tuple[Owner, list[ClaimGroup]]],
        done: bool,
        admit: ClaimAdmission | None = None,
    ) -> list[dict[str, Any] | None]:
        """Take back what a worker of the previous daemon holds, owner by owner.

        Only from a session that resumes one of the previous daemon's sessions and has not sent
        its ``done`` yet, during the claim period or after it (``daemon/core/claims.py``). Each
        owner is all or nothing: its blocks are claimed by id (never allocated anew), and if one of
        them is not free (another owner claimed it first) or not in this pool, the owner id is
        already held by another session, or ``admit`` (the budget) refuses it, none of that
        owner's claim stands. Per owner: None (accepted) or an ``{code, message}`` error.
        ``done`` ends this worker's re-sync, which may end the claim period.

        Raises:
            ClaimConflictError: This session may not claim (it resumes no session of the
                previous daemon's, or has finished its claims); nothing was claimed.
        """
        try:
            self._check_claimant(session)
        except ClaimConflictError as exc:
            self.n_owners_refused += len(owners)
            log.warning(
                "claim of %d owner(s) refused: session %x (pid %d): %s",
                len(owners),
                session.sid,
                session.pid,
                exc,
            )
            raise
        results: list[dict[str, Any] | None] = []
        errors = ItemErrors()
        for index, (owner, groups) in enumerate(owners):
            try:
                self._claim_owner(session, owner, groups, admit)
            except (ValueError, VqpoolError) as exc:
                self.n_owners_refused += 1
                log.warning(
                    "claim refused: owner %r of session %x (pid %d): %s",
                    owner,
                    session.sid,
                    session.pid,
                    exc,
                )
                results.append(errors.entry(index, exc))
            else:
                self.n_owners_claimed += 1
                results.append(None)
        if done and self.claim_period is not None:
            self.claim_period.note_done(session.pid, session.resumes, time.monotonic())
            if self.claiming is not None and self.claiming.ended is not None:
                self._claim_period_over()
        return results

    def _check_claimant(self, session: Session) -> None:
        """Refuse a claim from a session that may not claim: this daemon started with no worker
        of a previous one alive, or the session resumes no session of the previous daemon's
        workers (it never held a block of it), or it has finished its claims."""
        period = self.claim_period
        if period is None:
            raise ClaimConflictError(
                "claim: this vqpoold has no claim period (no worker of a previous daemon was "
                "alive when it started), so there is nothing to take back: nothing was claimed"
            )
        now = time.monotonic()
        if period.claimant(session.pid, session.resumes, now) is None:
            resumed = "none" if session.resumes is None else f"{session.resumes:x}"
            raise ClaimConflictError(
                f"claim: session {session.sid:x} (pid {session.pid}, resumes {resumed}) has no "
                "claim period: it resumes no session of the previous daemon's workers, or that "
                "session sent its done already; nothing was claimed"
            )
        if self.claiming is not None and period.ended is not None:
            self._claim_period_over()

    def _claim_owner(
        self,
        session: Session,
        owner: Owner,
        groups: list[ClaimGroup],
        admit: ClaimAdmission | None,
    ) -> None:
        """Claim one owner's groups, all or nothing (``admit`` first, if given)."""
        holder = self._holder.get(owner)
        if holder is not None and holder is not session:
            raise ClaimConflictError(
                f"claim: owner {owner!r} is already held by another worker session (pid "
                f"{holder.pid}); this worker's blocks of it were not taken back"
            )
        ids = [block_id for group in groups for block_id in group[2]]
        if len(set(ids)) != len(ids):
            raise ValueError(f"claim: owner {owner!r} lists a block id twice")
        undo: Callable[[], None] | None = None
        if admit is not None and groups:
            counts: FormatCounts = {}
            for stream, fmt, block_ids, _ in groups:
                counts[stream, fmt] = counts.get((stream, fmt), 0) + len(block_ids)
            undo = admit(session, owner, counts)
        allocator = self.allocator
        if holder is None and not groups:
            allocator.register_owner(owner)
        taken: list[tuple[int, ...]] = []
        try:
            for stream, fmt, block_ids, fills in groups:
                taken.append(allocator.claim_ids(owner, stream, block_ids, fills, fmt))
        except BaseException:
            for group_ids in taken:  # all or nothing per owner
                allocator.free_ids(group_ids)
            if holder is session and not allocator.is_active(owner):
                allocator.register_owner(owner)  # it was held with no block: keep it so
            if undo is not None:
                undo()
            raise
        self.n_blocks_claimed += len(ids)
        if holder is None:
            self._bind(owner, session)

    def check_claim_period(self, now: float) -> None:
        """End the claim period once it is over (called by the server loop's tick)."""
        claiming = self.claiming
        if claiming is not None and claiming.check(now):
            self._claim_period_over()

    def _claim_period_over(self) -> None:
        self.claiming = None
        self._roll_dirty = True  # drop expected sessions that never came back

    def write_roll(self) -> None:
        """Write the roll now: every session, and while claims are taken the expected sessions
        not resumed by one of them (a restart now must still wait for those)."""
        sessions = list(self.sessions)
        entries = [(session.process, session.sid) for session in sessions]
        if self.claiming is not None:
            resumed = {(s.pid, s.resumes) for s in sessions if s.resumes is not None}
            entries += [
                (process, sid)
                for (pid, sid), process in self.claiming.expected.items()
                if (pid, sid) not in resumed
            ]
        write_roll(self.run_dir, entries)
        for session in sessions:
            session.on_roll = True
        self._roll_dirty = False

    def write_roll_if_changed(self) -> None:
        """Write the roll if sessions opened or ended since it was last written (called by the
        server loop's tick: a burst of hellos or goodbyes costs one write, not one each)."""
        if self._roll_dirty:
            self.write_roll()

    def session_opened(self, session: Session, resumes: int | None) -> None:
        """Count a new session; it goes on the roll at the next tick, or before its first
        mutating request if that comes first (see ``WorkerRequestHandler``).

        Args:
            resumes: The session id the client held under the previous daemon lifetime.
        """
        self.n_sessions_opened += 1
        session.resumes = resumes
        self._roll_dirty = True

    # -- session lifecycle -------------------------------------------------------------------------

    def end_session(self, session: Session, counted: bool) -> SessionEnd:
        """Free everything ``session`` holds, release its owners and forget it; with
        ``counted``, count the blocks freed per (stream, format)."""
        allocator = self.allocator
        owners = list(session.owners)
        n_blocks = 0
        freed: FormatCounts = {}
        for owner in owners:
            n_blocks += allocator.n_blocks_for(owner)
            if counted:
                for kind, n in allocator.format_usage(owner).items():
                    freed[kind] = freed.get(kind, 0) + n
            allocator.free_all(owner)
            self._unbind(owner)
        self.sessions.close(session)
        self.replies.forget(session.sid)
        self._roll_dirty = True
        return SessionEnd(len(owners), n_blocks, freed)

    def dead_sessions(self, now: float) -> Iterator[tuple[Session, str]]:
        """Every session whose worker exited or stayed stopped past its lease, with why (one
        look at each process, however many sessions it holds). Lazy: the caller ends each one
        before the next process is looked at."""
        for process in self.sessions.processes():
            yield from process.reap_reasons(now, self.lease)

    # -- reads for the admin -----------------------------------------------------------------------

    def usage_by(self, session: Session) -> dict[Owner, dict[str, tuple[int, int]]]:
        """Each owner of ``session`` with its blocks and used token slots per stream
        (O(allocations held), no Block objects: admin views and metrics)."""
        return {owner: self.allocator.usage(owner) for owner in session.owners}

    def blocks_by_model(self) -> dict[str, int]:
        """Blocks the sessions of each model hold now, all streams together (O(chunks held):
        for the timeline's tick, never per request)."""
        held: dict[str, int] = {}
        for session in self.sessions:
            n = sum(self.allocator.n_blocks_for(owner) for owner in session.owners)
            held[session.model] = held.get(session.model, 0) + n
        return held

    def uptime(self) -> float:
        """Seconds since the daemon started."""
        return time.monotonic() - self.started_monotonic

    def audit(self) -> list[str]:
        """Every disagreement between the allocator, the owner map and the sessions (O(pool));
        the budget's own recount is the budget layer's."""
        problems: list[str] = []
        try:
            self.allocator.check_invariants()
        except AssertionError as exc:
            problems.append(f"allocator: {exc}")
        active = set(self.allocator.active_owners())
        held = set(self._holder)
        problems += [f"owner {o!r} is active but held by no session" for o in active - held]
        problems += [f"owner {o!r} is held by a session but inactive" for o in held - active]
        live = {id(s) for s in self.sessions}
        for owner, session in self._holder.items():
            if id(session) not in live:
                problems.append(f"owner {owner!r} is held by ended session {session.sid:x}")
            elif owner not in session.owners:
                problems.append(f"owner {owner!r} is missing from session {session.sid:x}")
        for session in self.sessions:
            for owner in session.owners:
                if self._holder.get(owner) is not session:
                    problems.append(f"session {session.sid:x} lists owner {owner!r} it lacks")
        return problems
