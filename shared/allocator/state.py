"""AllocatorState: what a BlockPoolAllocator knows, its reads, its owner registry, its audit.

The allocator's paths (allocate and free in ``block_pool_allocator``, the restart claims in
``claims``) update this state in place under its one lock. Here: the state itself, the counters
and their history, the owner registry, the reads, and the audit that recounts it all.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from itertools import repeat
from operator import itemgetter
from typing import cast

from vqpool.shared.allocator.block_list import BlockList, PoolBlock
from vqpool.shared.allocator.free_list import NO_MARK, FreeList
from vqpool.shared.errors import OwnerAlreadyActiveError
from vqpool.shared.pool import Block, Owner, PoolConfig
from vqpool.shared.stats import AllocationStats

# Stats snapshots kept in ``history``. Bounded so a long-running daemon does not grow on its own
# bookkeeping; recent pressure is what tells exhaustion coming, not the lifetime record.
DEFAULT_HISTORY_SIZE: int = 256

# Positions of the counters in AllocatorState._counts: AllocationStats' field order, so a
# snapshot is AllocationStats(*counts) and a history row is tuple(counts).
(
    N_BLOCKS,
    N_ALLOCATIONS,
    N_FREES,
    N_REUSED,
    N_EXHAUSTED,
    N_GROWN,
    N_RETIRED,
    PEAK_IN_USE,
    FRAGMENTED,
) = range(9)

# What the commonest calls did to the counters, logged instead of applied (``_events``): a code
# per call, folded into the counters and their history rows, in order, by _fold_locked().
# Applied inline, the counters and a history row cost a quarter of a one-block allocate + free
# (each counter past 256 is a new int object, each row a new tuple); a logged code costs one
# list append. A code is its call's changes as base-128 digits: allocations (each a reuse),
# frees, blocks made partial, blocks made full; so the sum of up to 127 codes is all of their
# changes at once (one C-level sum() of ints of one machine digit, no carries).
_DIGIT = 7
_DIGIT_MASK = (1 << _DIGIT) - 1
ALLOC_ONE = 1  # a one-block allocation of a recycled id, the block full
FREE_ONE = 1 << _DIGIT  # the free of a one-block allocation whole, the block full
FRAGMENT = 1 << 2 * _DIGIT  # mark_used() making a held block partial (no history row)
UNFRAGMENT = 1 << 3 * _DIGIT  # mark_used() making a held partial block full (no history row)
ALLOC_ONE_PARTIAL = ALLOC_ONE + FRAGMENT
FREE_ONE_PARTIAL = FREE_ONE + UNFRAGMENT
# Per code: blocks allocated, blocks freed, change of partial blocks (the tail of a fold).
_CHANGES = {
    ALLOC_ONE: (1, 0, 0),
    ALLOC_ONE_PARTIAL: (1, 0, 1),
    FREE_ONE: (0, 1, 0),
    FREE_ONE_PARTIAL: (0, 1, -1),
    FRAGMENT: (0, 0, 1),
    UNFRAGMENT: (0, 0, -1),
}
_ROW_CODES = frozenset((ALLOC_ONE, ALLOC_ONE_PARTIAL, FREE_ONE, FREE_ONE_PARTIAL))
# Codes logged before a free() or mark_used() folds them: bounds the log of a pool no one reads
# (allocations alone are bounded by the recycled ids, see FreeList.low).
FOLD_AT = 16384


class AllocatorState:
    """The bookkeeping of a :class:`~vqpool.shared.allocator.BlockPoolAllocator`.

    Every method takes the one internal (non-reentrant) lock; ``_locked`` helpers expect it held.
    """

    def __init__(self, config: PoolConfig | None = None) -> None:
        self.config = config or PoolConfig()
        streams = self.config.streams
        per_stream = self.config.n_blocks // len(streams)
        self._streams = streams
        self._separate_kv = self.config.separate_kv
        self._block_size = self.config.block_size
        self._lock = threading.Lock()
        self._free: dict[str, FreeList] = {
            s: FreeList(i * per_stream, (i + 1) * per_stream) for i, s in enumerate(streams)
        }
        self._free_lists = tuple(self._free.values())  # (the streams never change)
        # The first id never part of this pool: ids are unique across streams.
        self._next_block_id = per_stream * len(streams)
        # The *gap*: ids a restart's claims made part of the id space without a stream listing
        # them (a claim of id 5000 in a pool of 1,024 ids adds 1024..4999 too, unlisted: another
        # worker may claim them in either stream). It is [_gap_lo, _next_block_id) less
        # _gap_taken, the ids of it claimed since (held, or listed once freed); growth takes
        # from it first, so the id space stays dense. Empty (_gap_lo == _next_block_id)
        # unless claims named ids beyond the pool (see RestartClaims).
        self._gap_lo = self._next_block_id
        self._gap_taken: set[int] = set()
        # Growths that listed ids on a stack (the claim path's recycled-set key, see claims.py).
        self._n_listing_growths = 0
        # Block id -> the allocation (chunk) it came from; an entry is live while
        # the chunk is not dead. Entries left by free_all() are stale and overwritten on reuse.
        self._chunk_of: dict[int, BlockList] = {}
        # Live allocations of several blocks whose ids past the first are not in _chunk_of yet,
        # by id(chunk): allocate() writes the first id only (free_ids finds a whole allocation
        # by it), and every lookup by id writes the rest first (_index_locked). A whole
        # allocation freed before any such lookup (allocate + free_all, the commonest life)
        # never costs a map write per block.
        self._unindexed: dict[int, BlockList] = {}
        # Owner -> its live chunks in allocation order: the chunk itself while it is the only
        # one (most owners, and no dict to build), else a dict of them keyed by id(chunk). An
        # owner is here while it holds a block. See _hold_locked and _chunks_of.
        self._holdings: dict[Owner, BlockList | dict[int, BlockList]] = {}
        self._active_owners: set[Owner] = set()
        # One Block per id, as the seed keeps them, but made on the id's first allocate() or
        # claim() and then kept (PoolBlock): each public allocation points them at itself
        # instead of building new objects or setting their fields. Indexed by id (a list:
        # looking ids up in it costs a tenth of a dict's), None for an id not used yet; empty
        # until the first public allocation, so a pool of a million blocks costs nothing to
        # build. The ids path (allocate_ids,
        # claim_ids) neither makes nor changes them.
        self._block_objects: list[PoolBlock | None] = []
        # The AllocationStats counters as a plain list: updates are list stores and a history
        # row is one C-level tuple() copy (a stats object's nine attributes cost ~6x that).
        self._counts = [self._next_block_id, 0, 0, 0, 0, 0, 0, 0, 0]
        self._history: deque[tuple[int, ...]] = deque(maxlen=DEFAULT_HISTORY_SIZE)
        # Codes of the calls whose counter changes are not applied yet (see ALLOC_ONE): every
        # path that reads or changes the counters or the history folds them first.
        self._events: list[int] = []
        # How long the log may grow before a free() or mark_used() folds it: FOLD_AT, or
        # DEFAULT_HISTORY_SIZE while a fold is due (see _defer_fold_locked).
        self._fold_at = FOLD_AT

    # -- history -------------------------------------------------------------------------------

    def _record_history(self) -> None:
        self._history.append(tuple(self._counts))

    def _fold_locked(self, mark: bool = True) -> None:
        """Apply the logged codes to the counters, in order, each with the history row its call
        would have recorded, and set the free lists' marks anew (if ``mark``). All or nothing:
        whatever is raised inside, the counters, the history and the log are as they were.

        Only the last ``DEFAULT_HISTORY_SIZE`` rows can be kept: the codes before those are
        applied as their sum (in C). The peak in use needs no scan of them: while logged one-block
        allocations take no more recycled ids from the free lists than the headroom below the
        peak (each list's ``low`` mark, their shares summing to it), none of them can raise it;
        the one that takes more folds at once (or, in a batch, before the log holds more codes
        than rows kept: :meth:`_defer_fold_locked`), so it is always among the last rows.
        """
        events = self._events
        # The counters as locals while the codes are applied (a list item's += costs three
        # times a local's), committed at the end (all or nothing); each row built from them, in
        # AllocationStats' field order (see N_BLOCKS).
        n_blocks, n_allocations, n_frees, n_reused, n_exhausted, n_grown, n_retired, peak, frag = (
            self._counts
        )
        start = 0
        if len(events) > DEFAULT_HISTORY_SIZE:
            n_rows = 0
            start = len(events)
            while start and n_rows < DEFAULT_HISTORY_SIZE:
                start -= 1
                if events[start] in _ROW_CODES:
                    n_rows += 1
            for lo in range(0, start, _DIGIT_MASK):  # sums of at most 127 codes
                total = sum(events[lo : min(start, lo + _DIGIT_MASK)])
                allocated = total & _DIGIT_MASK
                n_allocations += allocated
                n_reused += allocated
                n_frees += (total >> _DIGIT) & _DIGIT_MASK
                frag += ((total >> 2 * _DIGIT) & _DIGIT_MASK) - (total >> 3 * _DIGIT)
        rows: list[tuple[int, ...]] = []
        append = rows.append
        changes = _CHANGES
        for code in events[start:] if start else events:
            allocated, freed, fragmented = changes[code]
            if fragmented:
                frag += fragmented
            if allocated:  # as allocate() applied it
                n_allocations += 1
                n_reused += 1
                if n_allocations - n_frees > peak:
                    peak = n_allocations - n_frees
            elif freed:  # as free() applied it
                n_frees += 1
            else:
                continue
            append(
                (
                    n_blocks,
                    n_allocations,
                    n_frees,
                    n_reused,
                    n_exhausted,
                    n_grown,
                    n_retired,
                    peak,
                    frag,
                )
            )
        self._history.extend(rows)
        self._counts[:] = (
            n_blocks,
            n_allocations,
            n_frees,
            n_reused,
            n_exhausted,
            n_grown,
            n_retired,
            peak,
            frag,
        )
        events.clear()
        self._fold_at = FOLD_AT
        if not mark:
            return
        # Until the next fold, blocks in use change only by logged calls, each a recycled id
        # taken or given back (a free that gives back a claimed id lists nothing: the count
        # errs high, safe), so each list may lose its share of the headroom before a fold.
        headroom = peak - (n_allocations - n_frees)
        free_lists = self._free_lists
        share = headroom // len(free_lists)
        for free in free_lists:
            free.low = len(free.recycled) - share
        free_lists[0].low -= headroom - share * len(free_lists)

    def _defer_fold_locked(self) -> None:
        """Leave a fold that is due (a free list past its mark) to the next call that logs a
        code or reads the counters, instead of doing it now: the next logged allocation folds
        at once (every mark cleared), and a free() or mark_used() once the log holds
        DEFAULT_HISTORY_SIZE codes, so every code logged since the fold fell due still gets its
        own row (the peak in use comes out the same). For a batch's caller that answers before
        anything reads the counters (the daemon folds them after its reply is sent). Needs
        fewer than DEFAULT_HISTORY_SIZE codes logged."""
        assert len(self._events) < DEFAULT_HISTORY_SIZE
        self._fold_at = DEFAULT_HISTORY_SIZE
        for free in self._free.values():
            free.low = NO_MARK

    def _settle_locked(self) -> None:
        """Fold the logged codes before a path that changes the counters itself, and clear the
        free lists' marks: that path may change blocks in use without a recycled id (the fresh
        range, growth, claims, retirement), so the next logged allocation folds again."""
        if self._events:
            self._fold_locked(mark=False)
        for free in self._free.values():
            free.low = NO_MARK

    @property
    def stats(self) -> AllocationStats:
        """The counters now, as one consistent snapshot (taken under the lock, so never half
        way through another thread's update)."""
        with self._lock:
            if self._events:
                self._fold_locked()
            return AllocationStats(*self._counts)

    @property
    def history_rows(self) -> deque[tuple[int, ...]]:
        """The live history deque itself (each row the counts tuple of one snapshot, a new
        tuple per row), no copy: for a caller on the thread that mutates the pool to notice new
        rows cheaply (the daemon stamps them with a time). Do not modify it."""
        if self._events:
            with self._lock:
                self._fold_locked()
        return self._history

    @property
    def history(self) -> deque[AllocationStats]:
        """The last ``DEFAULT_HISTORY_SIZE`` stats snapshots, oldest first, one per mutating call
        (allocate, including a failed one; free; free_all; a shrink that retired blocks)."""
        with self._lock:
            if self._events:
                self._fold_locked()
            rows = list(self._history)
        return deque((AllocationStats(*row) for row in rows), maxlen=DEFAULT_HISTORY_SIZE)

    # -- the Block objects of public allocations ---------------------------------------------

    def _list_blocks_locked(self, chunk: BlockList, id_end: int = 0) -> None:
        """Fill a new allocation's list with the Block objects of its ids (all below
        ``id_end``, or the pool's id space), making those not made yet; changes nothing the
        pool reads (making a Block can fail: this runs before the allocation changes anything).
        The allocation then points them at itself (:meth:`_hand_out_blocks_locked`)."""
        objects = self._block_objects
        id_end = max(id_end, self._next_block_id)
        if len(objects) < id_end:  # the first public allocation, or the pool grew since
            objects.extend(repeat(None, id_end - len(objects)))
        ids = chunk.block_ids
        # itemgetter: the fastest C-level gather of many list items (a tuple)
        found = itemgetter(*ids)(objects) if len(ids) > 1 else (objects[ids[0]],)
        if not all(found):  # an id's first public use (a Block is always true)
            made = list(found)
            for i, block_id in enumerate(ids):
                if made[i] is None:
                    made[i] = objects[block_id] = PoolBlock(block_id, chunk.stream, self, chunk)
            found = tuple(made)
        blocks = cast("tuple[PoolBlock, ...]", found)  # no None left
        chunk.extend(blocks)
        chunk._blocks = blocks

    @staticmethod
    def _hand_out_blocks_locked(chunk: BlockList) -> None:
        """Point the Block objects of an allocation just made at it: their owner, format and
        fill are read from it from now on (see PoolBlock)."""
        blocks = chunk._blocks
        assert blocks is not None
        # A plain loop: its attribute store is specialised for __slots__, faster than any
        # C-level setattr over the tuple.
        for block in blocks:
            block._chunk = chunk

    # -- holdings ----------------------------------------------------------------------------

    def _hold_locked(self, owner: Owner, chunk: BlockList) -> None:
        """File a new allocation under its owner (see ``_holdings``)."""
        holdings = self._holdings
        held = holdings.get(owner)
        if held is None:
            holdings[owner] = chunk
        elif type(held) is BlockList:  # a second allocation: from now on a dict
            holdings[owner] = {id(held): held, id(chunk): chunk}
        else:
            held[id(chunk)] = chunk

    def _chunks_of(self, owner: Owner) -> Iterable[BlockList]:
        """The live allocations of ``owner``, in allocation order."""
        held = self._holdings.get(owner)
        if held is None:
            return ()
        return held.values() if isinstance(held, dict) else (held,)

    # -- streams and owners ----------------------------------------------------------------------

    @property
    def streams(self) -> tuple[str, ...]:
        """The streams of this pool: ("k", "v") or ("kv",)."""
        return self._streams

    def _resolve_stream(self, stream: str) -> str:
        if not self._separate_kv:
            return "kv"
        if stream != "k" and stream != "v":
            raise ValueError(f"BlockPoolAllocator: stream must be 'k' or 'v', got {stream!r}")
        return stream

    def register_owner(self, owner: Owner) -> None:
        """Mark ``owner`` active, so that a second registration of a live id raises.

        allocate() registers unknown owners itself and treats a repeated allocate() for an active
        owner as that request growing. Call this once before the first allocate() to catch a
        genuine collision (a wrapped counter, two callers racing on one id).

        Raises:
            OwnerAlreadyActiveError: ``owner`` holds blocks or was registered and not released.
        """
        with self._lock:
            self._register_owner_locked(owner)

    def _register_owner_locked(self, owner: Owner) -> None:
        if owner in self._active_owners:
            raise OwnerAlreadyActiveError(
                f"BlockPoolAllocator: owner {owner!r} is already active (has checked-out blocks "
                "or was registered without a matching free_all/release_owner). Use a different "
                "owner id, or free_all(owner) first if this is intentional reuse."
            )
        self._active_owners.add(owner)

    def release_owner(self, owner: Owner) -> None:
        """Drop ``owner`` from the active set without freeing its blocks (free_all does both)."""
        with self._lock:
            self._active_owners.discard(owner)

    def is_active(self, owner: Owner) -> bool:
        """Whether ``owner`` is registered or holds blocks."""
        self._lock.acquire()  # not "with": once per owner a free touches
        try:
            return owner in self._active_owners
        finally:
            self._lock.release()

    def active_owners(self) -> list[Owner]:
        """Every active owner, including registered owners that hold no block."""
        with self._lock:
            return list(self._active_owners)

    def owners(self) -> list[Owner]:
        """Every owner that is active or holds blocks (release_owner() can leave an owner that
        holds blocks but is no longer active, as in the seed)."""
        with self._lock:
            return list(self._active_owners.union(self._holdings))

    # -- reads -----------------------------------------------------------------------------------

    def _index_locked(self) -> None:
        """Write the map entries of the allocations allocate() left unindexed."""
        unindexed = self._unindexed
        chunk_of = self._chunk_of
        while unindexed:
            key = next(iter(unindexed))
            chunk = unindexed[key]
            if not chunk.dead:  # (a dead one leaves this map as it dies)
                chunk_of.update(zip(chunk.block_ids, repeat(chunk)))
            del unindexed[key]  # only once written: an interrupted write is done again

    def _live_chunk(self, block_id: int) -> BlockList | None:
        if self._unindexed:
            self._index_locked()
        chunk = self._chunk_of.get(block_id)
        if chunk is None or chunk.dead:
            return None
        return chunk

    def blocks_for(self, owner: Owner) -> list[Block]:
        """Records of the blocks ``owner`` holds now, in allocation order."""
        with self._lock:
            if self._unindexed:
                self._index_locked()
            chunk_of = self._chunk_of
            size = self._block_size
            return [
                Block(
                    bid, chunk.stream, chunk.format, (chunk.fill or {}).get(bid, size), owner, True
                )
                for chunk in self._chunks_of(owner)
                for bid in chunk.block_ids
                if chunk_of.get(bid) is chunk
            ]

    def usage(self, owner: Owner) -> dict[str, tuple[int, int]]:
        """Per stream, how many blocks ``owner`` holds and how many token slots of them are
        used. O(allocations the owner holds), no Block objects: for admin views and metrics."""
        with self._lock:
            size = self._block_size
            usage: dict[str, tuple[int, int]] = {}
            for chunk in self._chunks_of(owner):
                n_held = len(chunk.block_ids) - chunk.n_freed
                unused = sum(size - n for n in chunk.fill.values()) if chunk.fill else 0
                n_blocks, n_tokens = usage.get(chunk.stream, (0, 0))
                usage[chunk.stream] = (n_blocks + n_held, n_tokens + n_held * size - unused)
            return usage

    def format_usage(self, owner: Owner) -> dict[tuple[str, str], int]:
        """Per (stream, format), how many blocks ``owner`` holds. O(allocations the owner
        holds): for the daemon's budget, which prices a block by its format."""
        with self._lock:
            counts: dict[tuple[str, str], int] = {}
            for chunk in self._chunks_of(owner):
                key = (chunk.stream, chunk.format)
                counts[key] = counts.get(key, 0) + len(chunk.block_ids) - chunk.n_freed
            return counts

    def n_blocks_for(self, owner: Owner) -> int:
        """How many blocks ``owner`` holds now."""
        with self._lock:
            return sum(len(c.block_ids) - c.n_freed for c in self._chunks_of(owner))

    def stream_format_of(self, block_id: int) -> tuple[str, str] | None:
        """The stream and format of ``block_id`` while it is allocated, else None (the daemon's
        budget prices a freed block by its stream and format)."""
        with self._lock:
            chunk = self._live_chunk(block_id)
            return None if chunk is None else (chunk.stream, chunk.format)

    def owner_of(self, block_id: int) -> Owner | None:
        """The owner holding ``block_id``, or None if it is free, retired or never existed."""
        self._lock.acquire()  # not "with", and _live_chunk() inlined: once per block freed
        try:
            if self._unindexed:
                self._index_locked()
            chunk = self._chunk_of.get(block_id)
            return None if chunk is None or chunk.dead else chunk.owner
        finally:
            self._lock.release()

    def n_free(self, stream: str = "k") -> int:
        """Free blocks left in ``stream``."""
        s = self._resolve_stream(stream)
        with self._lock:
            return self._free[s].n_free()

    def n_total(self, stream: str = "k") -> int:
        """Blocks ``stream`` manages now (free plus in use)."""
        s = self._resolve_stream(stream)
        with self._lock:
            return self._free[s].total

    # -- audit -----------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Recount everything and raise AssertionError on the first disagreement.

        O(pool size): for tests and admin audits, never for a hot path.
        """
        with self._lock:
            self._index_locked()
            self._fold_locked()
            held: dict[int, BlockList] = {}
            n_partial = 0
            for owner, filed in self._holdings.items():
                chunks = filed if isinstance(filed, dict) else {id(filed): filed}
                assert chunks, f"owner {owner!r} is listed with no blocks"
                for key, chunk in chunks.items():
                    assert key == id(chunk), f"owner {owner!r} files a chunk under a wrong key"
                    assert chunk.owner == owner, f"a chunk of {owner!r} names {chunk.owner!r}"
                    assert not chunk.dead, f"owner {owner!r} keeps a dead chunk"
                    live = [i for i in chunk.block_ids if self._chunk_of.get(i) is chunk]
                    assert live, f"owner {owner!r} keeps a chunk with no block in it"
                    assert len(live) + chunk.n_freed == len(chunk.block_ids), "free count off"
                    for block_id in live:
                        assert block_id not in held, f"block {block_id} is held twice"
                        held[block_id] = chunk
                    for block_id, n_used in (chunk.fill or {}).items():
                        assert block_id in live, f"partial block {block_id} is not held"
                        assert 0 <= n_used < self._block_size, f"block {block_id} n_used {n_used}"
                    n_partial += len(chunk.fill or ())
            live_entries = {i for i, c in self._chunk_of.items() if not c.dead}
            assert live_entries == held.keys(), "block map and owners' chunks disagree"

            seen_free: set[int] = set()
            for s, free in self._free.items():
                listed = [*range(free.fresh_lo, free.fresh_hi), *free.recycled]
                assert len(set(listed)) == len(listed), f"stream {s!r}: an id is free twice"
                assert free.claimed <= set(listed), f"stream {s!r}: a claimed id is not listed"
                assert free.claimed <= held.keys(), f"stream {s!r}: a claimed id is not held"
                assert free.never_used <= set(listed), (
                    f"stream {s!r}: a never-used id is not listed as free"
                )
                ids = [i for i in listed if i not in free.claimed]
                in_use = sum(1 for c in held.values() if c.stream == s)
                assert len(ids) + in_use == free.total, (
                    f"stream {s!r}: free {len(ids)} + in use {in_use} != total {free.total}"
                )
                assert seen_free.isdisjoint(ids), f"stream {s!r}: an id is free in two streams"
                seen_free.update(ids)
            assert seen_free.isdisjoint(held), "a block is both free and held"

            st = AllocationStats(*self._counts)
            assert st._fragmented_count == n_partial, (
                f"fragmented count {st._fragmented_count} != recount {n_partial}"
            )
            assert st.blocks_in_use() == len(held), (
                f"blocks_in_use {st.blocks_in_use()} != recount {len(held)}"
            )
            total = sum(free.total for free in self._free.values())
            assert st.n_blocks == total, f"n_blocks {st.n_blocks} != recount {total}"
            gap_lo, top, taken = self._gap_lo, self._next_block_id, self._gap_taken
            assert gap_lo <= top, f"gap starts at {gap_lo}, past the id space's end {top}"
            assert all(gap_lo <= i < top for i in taken), "a taken gap id is outside the gap"
            in_pool = seen_free.union(held)
            assert all(i < top for i in in_pool), "an id of the pool is past the id space"
            assert all(i in taken for i in in_pool if i >= gap_lo), "a gap id is in the pool"
