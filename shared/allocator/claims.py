"""The restart claim path: a restarted daemon takes back, by id, the blocks its workers hold.

Claimed ids are taken out of the middle of a stream's free list without moving anything
(``FreeList.claimed``); what that costs the other paths later (allocate passing them, shrink
unlisting them) is in :class:`~vqpool.shared.allocator.free_list.FreeList`.

A growing pool may have grown past its first id space before the restart: a claim of an id
beyond the pool, within what the pool may grow to (``max_blocks``), grows the pool to hold it.
The ids skipped on the way join no stream yet (the *gap*, see ``AllocatorState``): another
worker may claim them in either stream, and growth hands them out before new ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

from vqpool.shared.allocator.block_list import BlockList, new_record
from vqpool.shared.allocator.free_list import FreeList
from vqpool.shared.allocator.state import (
    FRAGMENTED,
    N_ALLOCATIONS,
    N_BLOCKS,
    N_FREES,
    N_GROWN,
    N_RETIRED,
    PEAK_IN_USE,
    AllocatorState,
)
from vqpool.shared.errors import ClaimConflictError
from vqpool.shared.pool import Owner


class RestartClaims(AllocatorState):
    """The allocator's state with :meth:`claim` and :meth:`claim_ids`: the one path that takes
    the ids it is given instead of the top of a free list."""

    def claim(
        self,
        owner: Owner,
        stream: str,
        block_ids: Sequence[int],
        fills: Sequence[int] | None = None,
        format: str = "fp16",
    ) -> BlockList:
        """Hand these exact free block ids to ``owner``, all or nothing: O(len(block_ids)).

        This is how a restarted daemon takes back what its workers still hold: each worker
        re-declares its blocks and they are claimed by id instead of allocated. The ids leave the
        free list where they are (claimed ids in the never-used range included), so nothing is
        moved or searched. ``owner`` may already be active (a second claim adds to what it
        holds). ``fills[i]`` is how many slots of ``block_ids[i]`` are used (None: all full).
        The claim counts as an allocation in the stats (``n_allocations``; ``n_reused`` is
        counted, as always, when an id is next allocated). An id beyond the pool of a pool that
        grows, within ``max_blocks``, is taken too: the pool grows to hold it (``n_grown``).

        Raises:
            ValueError: No ids, an id listed twice, ``fills`` not one value in 0..block_size per
                id, or a stream this pool does not have.
            ClaimConflictError: An id that is not free in ``stream``: held by an owner, retired
                by shrink, in another stream, or beyond what this pool may grow to. Nothing was
                claimed.
        """
        return self._claim_chunk(owner, stream, block_ids, fills, format, True)

    def claim_ids(
        self,
        owner: Owner,
        stream: str,
        block_ids: Sequence[int],
        fills: Sequence[int] | None = None,
        format: str = "fp16",
    ) -> tuple[int, ...]:
        """claim() for callers that need only the ids (the daemon): the same claim, the same
        errors, but no ``Block`` object is built. Returns the ids claimed, in order."""
        return self._claim_chunk(owner, stream, block_ids, fills, format, False).block_ids

    def _claim_chunk(
        self,
        owner: Owner,
        stream: str,
        block_ids: Sequence[int],
        fills: Sequence[int] | None,
        format: str,
        with_blocks: bool,
    ) -> BlockList:
        """claim(): the new allocation's record, its list filled with Blocks if
        ``with_blocks`` (built before anything changes)."""
        s = self._resolve_stream(stream)
        ids = tuple(block_ids)
        if not ids:
            raise ValueError("BlockPoolAllocator: claim needs at least one block id")
        if len(set(ids)) != len(ids):
            raise ValueError(f"BlockPoolAllocator: claim lists a block id twice: {list(ids)}")
        block_size = self._block_size
        fill: dict[int, int] = {}
        if fills is not None:
            if len(fills) != len(ids):
                raise ValueError(
                    f"BlockPoolAllocator: claim has {len(ids)} block ids but {len(fills)} fills"
                )
            for block_id, n_used in zip(ids, fills, strict=True):
                if type(n_used) is not int or not 0 <= n_used <= block_size:
                    raise ValueError(
                        f"BlockPoolAllocator: n_used must be in 0..{block_size}, got {n_used!r}"
                    )
                if n_used < block_size:
                    fill[block_id] = n_used
        with self._lock:
            self._settle_locked()  # (the counters are read and changed below)
            free = self._free[s]
            lo, hi, claimed = free.fresh_lo, free.fresh_hi, free.claimed
            gap_lo, gap_taken = self._gap_lo, self._gap_taken
            recycled: set[int] | None = None  # built only if an id is not in the fresh range
            grown: list[int] = []  # ids of the gap or beyond the pool: the pool grows by them
            for block_id in ids:
                if lo <= block_id < hi and block_id not in claimed:
                    continue
                if block_id >= gap_lo and block_id not in gap_taken:
                    self._check_growth_claim_locked(block_id, s, len(grown) + 1)
                    grown.append(block_id)
                    continue
                chunk = self._live_chunk(block_id)
                if chunk is not None or block_id in claimed:
                    holder = chunk.owner if chunk is not None else "another owner"
                    raise ClaimConflictError(
                        f"BlockPoolAllocator: block {block_id} is held by {holder!r}; "
                        "nothing was claimed"
                    )
                if recycled is None:
                    recycled = self._recycled_ids_locked(free)
                if block_id not in recycled:
                    raise ClaimConflictError(
                        f"BlockPoolAllocator: block {block_id} is not a block of stream {s!r} "
                        f"in this pool (retired, another stream's, or beyond the pool's "
                        f"{self._counts[N_BLOCKS]} blocks); nothing was claimed"
                    )
            chunk = new_record(ids, s, format, owner)
            if fill:
                chunk.fill = fill
            if with_blocks:
                self._list_blocks_locked(chunk, max(ids) + 1)
            if grown:
                listed = set(ids).difference(grown)
                claimed.update(listed)
                gap_taken.update(grown)
                self._next_block_id = max(self._next_block_id, max(grown) + 1)
                free.total += len(grown)
            else:
                claimed.update(ids)
            self._hold_locked(owner, chunk)
            self._chunk_of.update(zip(ids, repeat(chunk)))
            self._active_owners.add(owner)
            counts = self._counts
            counts[FRAGMENTED] += len(fill)
            counts[N_ALLOCATIONS] += len(ids)
            counts[N_BLOCKS] += len(grown)
            counts[N_GROWN] += len(grown)
            in_use = counts[N_ALLOCATIONS] - counts[N_FREES]
            counts[PEAK_IN_USE] = max(counts[PEAK_IN_USE], in_use)
            self._record_history()
            if with_blocks:
                self._hand_out_blocks_locked(chunk)
            return chunk

    def _check_growth_claim_locked(self, block_id: int, stream: str, n_grown: int) -> None:
        """Refuse ``block_id``, an id no stream lists (of the gap or beyond the pool), unless
        the pool may grow to hold it as the ``n_grown``-th id of this claim.

        Raises:
            ClaimConflictError: The pool does not grow, ``block_id`` is past ``max_blocks``, or
                the pool would then hold more than ``max_blocks`` blocks.
        """
        config = self.config
        n_blocks = self._counts[N_BLOCKS]
        why = ""
        if not config.grow_on_exhaustion:
            why = f"beyond the pool's {n_blocks} blocks, and the pool does not grow"
        elif config.max_blocks is not None and block_id >= config.max_blocks:
            why = f"beyond the {config.max_blocks} blocks this pool may grow to"
        elif config.max_blocks is not None and n_blocks + n_grown > config.max_blocks:
            why = (
                f"the pool holds {n_blocks} blocks and may grow to {config.max_blocks}: no "
                "room to take it"
            )
        if why:
            raise ClaimConflictError(
                f"BlockPoolAllocator: block {block_id} is not a block of stream {stream!r} in "
                f"this pool: {why}; nothing was claimed"
            )

    def _plan_gap_locked(self, n: int) -> tuple[list[int], int, list[int]]:
        """Up to ``n`` ids of the gap for a growth, lowest first; changes nothing. Returns the
        ids, where the gap then starts, and the taken ids passed on the way (they leave the
        taken set: below the gap's start, they are ordinary ids of their stream)."""
        lo, top, taken = self._gap_lo, self._next_block_id, self._gap_taken
        ids: list[int] = []
        passed: list[int] = []
        while lo < top and len(ids) < n:
            (passed if lo in taken else ids).append(lo)
            lo += 1
        return ids, lo, passed

    def _recycled_ids_locked(self, free: FreeList) -> set[int]:
        """The ids on ``free``'s recycled stack as a set, for claim(): built once and reused by
        the claims that follow, so that one claim message of thousands of one-id groups costs
        O(stack + ids), not O(stack x groups).

        Reused while nothing was added to the stack or retired from the pool since it was built,
        with no cost on the hot paths: an id joins the stack only by a free (the frees counter
        moves), a growth (counted by ``_n_listing_growths``; a claim that grows the pool lists
        nothing) or, in shrink, a move off the never-used range
        (``fresh_hi`` moves); it leaves the pool only by a shrink (the retired counter moves).
        Anything else that takes an id off the stack hands it out, and claim() refuses a held id
        before it asks this set, so a set that still lists it is never wrong. Claims themselves
        move none of these, so they keep the set; the undo of a refused owner's claims counts
        as frees and costs one rebuild.
        """
        counts = self._counts
        key = (counts[N_FREES], self._n_listing_growths, counts[N_RETIRED], free.fresh_hi)
        return free.recycled_set(key)
