"""BlockPoolAllocator: allocate, free, shrink and fill, the paths every worker's call takes.

These are the hot paths: they work on the state (``AllocatorState``) and the free lists
(``FreeList``) in place, inline, under the one lock; the rarer changes are the free list's
methods and the claim path's (``RestartClaims``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from operator import is_

from vqpool.shared.allocator.block_list import BlockList, PoolBlock, new_record
from vqpool.shared.allocator.claims import RestartClaims
from vqpool.shared.allocator.free_list import FreeList
from vqpool.shared.allocator.state import (
    ALLOC_ONE,
    ALLOC_ONE_PARTIAL,
    DEFAULT_HISTORY_SIZE,
    FRAGMENT,
    FRAGMENTED,
    FREE_ONE,
    FREE_ONE_PARTIAL,
    N_ALLOCATIONS,
    N_BLOCKS,
    N_EXHAUSTED,
    N_FREES,
    N_GROWN,
    N_RETIRED,
    N_REUSED,
    PEAK_IN_USE,
    UNFRAGMENT,
)
from vqpool.shared.errors import BlockPoolExhaustedError, VqpoolError
from vqpool.shared.pool import AllocationRequest, AllocationResult, Block, Owner


class BlockPoolAllocator(RestartClaims):
    """Fixed-size block allocator for KV-cache storage.

    Hands out blocks per owner (request) and stream, reusing freed ids LIFO (a just-freed block
    is the one most likely still in cache), so steady-state generation allocates no new memory.

    Thread-safe: every method takes one internal (non-reentrant) lock, so one pool can serve
    several threads without outside locking.

    Example::

        pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=256))
        blocks = pool.allocate(stream="k", n_tokens=40, owner=request_id, format="int2")
        ...
        pool.free_all(owner=request_id)
    """

    # -- allocate --------------------------------------------------------------------------------

    def allocate(self, stream: str, n_tokens: int, owner: Owner, format: str = "fp16") -> BlockList:
        """Allocate ceil(n_tokens / block_size) blocks to ``owner``, all or nothing.

        Every block is full except possibly the last, which holds the remainder. A repeated call
        for an active owner adds to what it holds (a request growing). Whatever is raised inside
        (MemoryError, KeyboardInterrupt included), nothing is allocated and no owner registered;
        blocks the pool grew by stay, free.

        Returns:
            The new blocks, one ``Block`` each, in a :class:`BlockList` (a real ``list``).

        Raises:
            ValueError: ``n_tokens`` <= 0, or a stream this pool does not have.
            BlockPoolExhaustedError: Too few free blocks and no room to grow; nothing allocated
                (the owner stays registered, as in the seed).
        """
        block_size = self._block_size
        if not self._separate_kv:
            stream = "kv"
        elif stream != "k" and stream != "v":
            return self._allocate_chunk(stream, n_tokens, owner, format, True)  # (it raises)
        if 0 < n_tokens <= block_size:
            # The commonest call (a decode step's next block), inline: one recycled id whose
            # Block exists, nothing claimed and nothing never used on the stack. Anything else
            # takes the general path.
            self._lock.acquire()  # not "with": see _allocate_chunk()
            try:
                free = self._free[stream]
                recycled = free.recycled
                try:
                    block = (
                        self._block_objects[recycled[-1]]
                        if recycled and not free.claimed and not free.never_used
                        else None
                    )
                except IndexError:  # past every Block made yet
                    block = None
                if block is not None:
                    block_id = block.block_id
                    # new_record(), inlined: the call is a tenth of this allocate()
                    held = block.alone
                    chunk = BlockList(held)
                    chunk.block_ids = block.alone_id
                    chunk.stream = stream
                    chunk.format = format
                    chunk.owner = owner
                    if n_tokens < block_size:
                        if (fill := block.alone_fill) is None:
                            fill = block.alone_fill = {}
                        fill[block_id] = n_tokens
                        chunk.fill = fill
                    else:
                        chunk.fill = None
                    chunk.n_freed = 0
                    chunk.dead = False
                    chunk._blocks = held
                    self._file_one_locked(chunk, block_id, owner, free, n_tokens < block_size)
                    block._chunk = chunk
                    return chunk
            finally:
                self._lock.release()
        return self._allocate_chunk(stream, n_tokens, owner, format, True)

    def allocate_ids(
        self, stream: str, n_tokens: int, owner: Owner, format: str = "fp16"
    ) -> tuple[int, ...]:
        """allocate() for callers that need only the ids (the daemon): the same allocation, the
        same errors, but no ``Block`` object is built. Free them with :meth:`free_ids`."""
        block_size = self._block_size
        if not self._separate_kv:
            stream = "kv"
        elif stream != "k" and stream != "v":
            return self._allocate_chunk(stream, n_tokens, owner, format, False).block_ids
        if 0 < n_tokens <= block_size:
            # One recycled id, nothing claimed and nothing never used: as allocate()'s
            self._lock.acquire()  # not "with": see _allocate_chunk()
            try:
                free = self._free[stream]
                if free.recycled and not free.claimed and not free.never_used:
                    block_id = free.recycled[-1]
                    # new_record(), inlined: one call less on the daemon's commonest request
                    chunk = BlockList()
                    chunk.block_ids = (block_id,)
                    chunk.stream = stream
                    chunk.format = format
                    chunk.owner = owner
                    chunk.n_freed = 0
                    chunk.dead = False
                    chunk._blocks = None
                    if n_tokens < block_size:
                        chunk.fill = {block_id: n_tokens}
                        self._file_one_locked(chunk, block_id, owner, free, True)
                    else:
                        chunk.fill = None
                        self._file_one_locked(chunk, block_id, owner, free, False)
                    return chunk.block_ids
            finally:
                self._lock.release()
        return self._allocate_chunk(stream, n_tokens, owner, format, False).block_ids

    def allocate_ids_each(
        self,
        items: Sequence[tuple[str, int, Owner, str]],
        results: list[tuple[int, ...] | ValueError | VqpoolError],
        unbound: set[Owner],
    ) -> int:
        """allocate_ids() per ``(stream, n_tokens, owner, format)`` item, in order, under one
        lock (a decode step's batch): each item allocates or fails on its own, as the call would.

        Appends to ``results``, as each item is done, its ids or the error its call raised, so
        a caller interrupted by anything else raised knows what was allocated (it undoes it).
        The owner of a failed item that is in ``unbound`` and for which no earlier item of this
        call allocated is released, as release_owner() would (the caller's all or nothing).
        Returns how many items failed."""
        block_size = self._block_size
        one_stream = None if self._separate_kv else "kv"
        free_lists = self._free
        active = self._active_owners
        chunk_of = self._chunk_of
        holdings = self._holdings
        events = self._events
        allocate_chunk = self._allocate_chunk_locked
        append = results.append
        served: set[Owner] = set()  # owners of ``unbound`` allocated for by an earlier item
        n_failed = 0
        # A free list went below its mark (see _fold_locked): the logged codes are folded once,
        # after the batch (_defer_fold_locked), instead of at each mark an item passes, as long
        # as they stay few enough to each get their history row (the peak comes out the same).
        fold_due = False
        self._lock.acquire()  # not "with": see _allocate_chunk()
        try:
            for stream, n_tokens, owner, format in items:
                if one_stream:
                    stream = one_stream
                free = free_lists.get(stream)
                if (
                    free is None
                    or not 0 < n_tokens <= block_size
                    or not free.recycled
                    or free.claimed
                    or free.never_used
                ):
                    try:
                        chunk = allocate_chunk(stream, n_tokens, owner, format, False)
                    except (ValueError, VqpoolError) as exc:
                        if owner in unbound and owner not in served:
                            active.discard(owner)
                        append(exc.with_traceback(None))  # (a flood's thousands keep no frames)
                        n_failed += 1
                        continue
                    if unbound:
                        served.add(owner)
                    append(chunk.block_ids)
                    continue
                # One recycled id, nothing claimed or never used: allocate_ids(), new_record()
                # and _file_one_locked() inlined (two calls cost as much as the rest per item).
                recycled = free.recycled
                block_id = recycled[-1]
                chunk = BlockList()
                chunk.block_ids = (block_id,)
                chunk.stream = stream
                chunk.format = format
                chunk.owner = owner
                chunk.n_freed = 0
                chunk.dead = False
                chunk._blocks = None
                if n_tokens < block_size:
                    chunk.fill = {block_id: n_tokens}
                    code = ALLOC_ONE_PARTIAL
                else:
                    chunk.fill = None
                    code = ALLOC_ONE
                was_active = owner in active
                logged = False
                try:
                    chunk_of[block_id] = chunk
                    if holdings.setdefault(owner, chunk) is not chunk:
                        self._hold_locked(owner, chunk)  # it holds others
                    active.add(owner)
                    recycled.pop()
                    events.append(code)
                    logged = True
                    if fold_due or len(recycled) < free.low:
                        if len(events) < DEFAULT_HISTORY_SIZE:
                            fold_due = True
                        else:
                            self._fold_locked()  # (all or nothing)
                            fold_due = False
                except BaseException:
                    self._undo_file_one_locked(chunk, block_id, free, was_active, logged)
                    raise
                if unbound:
                    served.add(owner)
                append(chunk.block_ids)
            if fold_due:
                self._defer_fold_locked()
        finally:
            self._lock.release()
        return n_failed

    def _file_one_locked(
        self, chunk: BlockList, block_id: int, owner: Owner, free: FreeList, partial: bool
    ) -> None:
        """Hand out ``block_id``, the recycled id on top of ``free``, as the one-block allocation
        ``chunk`` of ``owner`` (made, not filed yet), its counters logged (see ALLOC_ONE). All
        or nothing: whatever is raised inside, nothing is allocated and no owner registered."""
        recycled = free.recycled
        active = self._active_owners
        was_active = owner in active
        events = self._events
        logged = False
        try:
            self._chunk_of[block_id] = chunk
            if self._holdings.setdefault(owner, chunk) is not chunk:
                self._hold_locked(owner, chunk)  # it holds others
            active.add(owner)
            recycled.pop()
            events.append(ALLOC_ONE_PARTIAL if partial else ALLOC_ONE)
            logged = True
            if len(recycled) < free.low:  # past its mark: it may raise the peak
                self._fold_locked()  # (all or nothing)
        except BaseException:
            self._undo_file_one_locked(chunk, block_id, free, was_active, logged)
            raise

    def _undo_file_one_locked(
        self, chunk: BlockList, block_id: int, free: FreeList, was_active: bool, logged: bool
    ) -> None:
        """Undo an interrupted :meth:`_file_one_locked` (or its inlined copy): its allocation
        dropped, its code unlogged if ``logged``, ``block_id`` back on top of ``free``."""
        if logged:
            self._events.pop()
        self._undo_allocate_locked(chunk, was_active)
        recycled = free.recycled
        if not recycled or recycled[-1] != block_id:
            recycled.append(block_id)

    def _allocate_chunk(
        self, stream: str, n_tokens: int, owner: Owner, format: str, with_blocks: bool
    ) -> BlockList:
        """allocate(): the new allocation's record, its list filled with the pool's Blocks if
        ``with_blocks`` (listed before anything changes, as making them can fail; their fields
        set once the allocation is made)."""
        # acquire/release rather than "with": on this hot path the context manager
        # protocol costs about as much as the bookkeeping itself.
        self._lock.acquire()
        try:
            return self._allocate_chunk_locked(stream, n_tokens, owner, format, with_blocks)
        finally:
            self._lock.release()

    def _allocate_chunk_locked(
        self, stream: str, n_tokens: int, owner: Owner, format: str, with_blocks: bool
    ) -> BlockList:
        if n_tokens <= 0:
            raise ValueError(f"BlockPoolAllocator: n_tokens must be > 0, got {n_tokens}")
        if not self._separate_kv:
            stream = "kv"
        elif stream != "k" and stream != "v":
            raise ValueError(f"BlockPoolAllocator: stream must be 'k' or 'v', got {stream!r}")
        block_size = self._block_size
        n_needed = -(-n_tokens // block_size)
        self._settle_locked()  # (the counters are read and changed below)
        free = self._free[stream]
        recycled = free.recycled
        claimed = free.claimed
        n_listed = len(recycled)
        # Enough recycled ids and none claimed (the common case) needs no count of the rest.
        if (claimed or n_listed < n_needed) and (
            n_listed + free.fresh_hi - free.fresh_lo - len(claimed) < n_needed
        ):
            self._try_grow_locked(stream, n_needed)
            n_free = free.n_free()
            if n_free < n_needed:
                self._active_owners.add(owner)  # an exhausted owner stays registered (seed)
                self._counts[N_EXHAUSTED] += 1
                self._record_history()
                raise BlockPoolExhaustedError(
                    f"BlockPoolAllocator: requested {n_needed} block(s) for stream "
                    f"{stream!r} but only {n_free} free (pool size {self._counts[N_BLOCKS]})."
                )
        # Choose the ids first, changing nothing: from the top, recycled ids first (LIFO),
        # then the fresh range downwards. The stack is cut to its first ``keep`` ids.
        n_listed = len(recycled)  # growth may have added some
        hi = free.fresh_hi
        passed: list[int] | None = None  # claimed ids met on the way: they leave the list
        if claimed:
            ids, n_reused, keep, new_hi, passed = free.plan_past_claimed(n_needed)
            stack_top = recycled[keep:]
        elif n_needed == 1:  # a decode step's next block
            if n_listed:
                ids, n_reused, keep, new_hi = (recycled[-1],), 1, n_listed - 1, hi
            else:
                ids, n_reused, keep, new_hi = (hi - 1,), 0, 0, hi - 1
        else:
            n_reused = n_needed if n_needed <= n_listed else n_listed
            keep = n_listed - n_reused
            new_hi = hi - (n_needed - n_reused)
            taken = recycled[keep:]
            taken.reverse()
            if new_hi < hi:
                taken.extend(range(hi - 1, new_hi - 1, -1))
            ids = tuple(taken)
        chunk = new_record(ids, stream, format, owner)
        last_used = n_tokens - (n_needed - 1) * block_size
        if last_used < block_size:
            chunk.fill = {ids[-1]: last_used}
        if with_blocks:
            self._list_blocks_locked(chunk)
        active = self._active_owners
        was_active = owner in active
        unused = free.never_used  # on the stack, never handed out
        never_used = passed_unused = None
        if unused:
            if n_reused:
                never_used = unused.intersection(ids)
            if passed:
                passed_unused = unused.intersection(passed)
        counts = self._counts
        peak = counts[PEAK_IN_USE]
        counted = False
        # Then change everything; whatever is raised on the way is undone.
        try:
            self._chunk_of[ids[0]] = chunk
            if n_needed > 1:  # the rest on the first lookup by id, if any (_index_locked)
                self._unindexed[id(chunk)] = chunk
            self._hold_locked(owner, chunk)
            active.add(owner)
            if keep == n_listed - 1:
                recycled.pop()
            elif keep < n_listed:
                del recycled[keep:]
            if new_hi != hi:
                free.fresh_hi = new_hi
            if passed:
                claimed.difference_update(passed)
                if passed_unused:
                    unused -= passed_unused
            if never_used:
                unused -= never_used
                n_reused -= len(never_used)
            if last_used < block_size:
                counts[FRAGMENTED] += 1
            counts[N_ALLOCATIONS] += n_needed
            if n_reused:
                counts[N_REUSED] += n_reused
            in_use = counts[N_ALLOCATIONS] - counts[N_FREES]
            if in_use > peak:
                counts[PEAK_IN_USE] = in_use
            counted = True
            self._history.append(tuple(counts))
            if with_blocks:
                # _hand_out_blocks_locked(), inlined: one call less per allocate()
                for block in chunk._blocks:  # type: ignore[union-attr]
                    block._chunk = chunk
        except BaseException:
            self._undo_allocate_locked(chunk, was_active)
            if len(recycled) != n_listed:  # the stack was cut at ``keep``: put its top back
                recycled.extend(stack_top if passed else reversed(ids[: n_listed - keep]))
            free.fresh_hi = hi
            if passed:
                claimed.update(passed)
            unused.update(never_used or (), passed_unused or ())
            if counted:
                counts[FRAGMENTED] -= last_used < block_size
                counts[N_ALLOCATIONS] -= n_needed
                counts[N_REUSED] -= n_reused
                counts[PEAK_IN_USE] = peak
            raise
        return chunk

    def _undo_allocate_locked(self, chunk: BlockList, was_active: bool) -> None:
        """Drop the allocation an interrupted allocate() was recording, whatever it got to: the
        map entries it wrote are stale once ``chunk`` is dead."""
        chunk.dead = True
        self._unindexed.pop(id(chunk), None)
        owner = chunk.owner
        held = self._holdings.get(owner)
        if held is chunk or (  # its only allocation, or the last of several
            isinstance(held, dict) and held.pop(id(chunk), None) is not None and not held
        ):
            del self._holdings[owner]
        if not was_active:
            self._active_owners.discard(owner)

    def allocate_many(self, requests: Sequence[AllocationRequest]) -> list[AllocationResult]:
        """Run several allocate() calls in order; each item succeeds or fails on its own.

        Returns, per item, its blocks or the exception allocate() raised for it (nothing is
        raised here), so one exhausted sequence does not undo the others of a decode step.
        """
        results: list[AllocationResult] = []
        for request in requests:
            try:
                results.append(self.allocate(*request))
            except (ValueError, VqpoolError) as exc:
                results.append(exc)
        return results

    def _try_grow_locked(self, stream: str, n_needed: int) -> None:
        """Add blocks to ``stream`` to cover its shortfall for ``n_needed``, if allowed."""
        if not self.config.grow_on_exhaustion:
            return
        free = self._free[stream]
        n_short = n_needed - free.n_free()
        if self.config.max_blocks is not None:
            n_short = min(n_short, self.config.max_blocks - self._counts[N_BLOCKS])
        if n_short <= 0:
            return
        first = self._next_block_id
        if self._gap_lo == first:  # no gap (always, but after a restart's claims)
            free.grow(range(first, first + n_short))
            self._next_block_id = self._gap_lo = first + n_short
        else:  # ids of the gap first, then new ones
            new_ids, gap_lo, passed = self._plan_gap_locked(n_short)
            n_new = n_short - len(new_ids)
            new_ids.extend(range(first, first + n_new))
            free.grow(new_ids)
            self._gap_taken.difference_update(passed)
            self._gap_lo = gap_lo if not n_new else first + n_new
            self._next_block_id = first + n_new
        self._n_listing_growths += 1
        self._counts[N_BLOCKS] += n_short
        self._counts[N_GROWN] += n_short

    # -- free ------------------------------------------------------------------------------------

    def free(self, blocks: Iterable[Block]) -> None:
        """Return blocks to their stream's free list. Already-free blocks are skipped.

        Blocks are found by id, so freeing a copy frees the block; each Block object passed is
        marked free (owner None, n_used 0), as the seed's shared objects were (the pool's own
        objects show it by themselves). A list allocate() returned frees what it lists now,
        whatever its caller changed in it.
        """
        # An allocation's own list still holding just the Block objects listed for it (same
        # objects, same order: an O(len) check in C) is the whole allocation; so is the record
        # of an ids-path allocation (free_ids passes it, no caller has it).
        if type(blocks) is BlockList and (
            (held := blocks._blocks) is None
            or (len(held) == 1 == len(blocks) and blocks[0] is held[0])
            or (len(blocks) == len(held) and all(map(is_, blocks, held)))
        ):
            self._lock.acquire()  # not "with": see allocate()
            try:
                if blocks.dead or blocks.n_freed:
                    self._free_ids_locked(blocks.block_ids)  # (it folds the events)
                    self._record_history()
                    return
                # The common case: a whole live allocation none of whose blocks was freed
                # alone. No per-block bookkeeping: its map entries just go stale, and its
                # Blocks, pointing at a dead allocation, read as free.
                blocks.dead = True
                if self._unindexed:  # never looked up by id: its other entries never written
                    self._unindexed.pop(id(blocks), None)
                ids = blocks.block_ids
                free = self._free[blocks.stream]
                if free.claimed:
                    free.give_back(ids)
                else:
                    free.recycled.extend(ids)
                # _drop_chunk_locked(), inlined for an owner of one allocation
                owner = blocks.owner
                holdings = self._holdings
                held_now = holdings.pop(owner)
                if held_now is blocks:
                    self._active_owners.discard(owner)
                else:  # one of several: back as it was
                    holdings[owner] = held_now
                    self._drop_chunk_locked(blocks)
                events = self._events
                if len(ids) == 1:  # its counters and history row, logged
                    events.append(FREE_ONE_PARTIAL if blocks.fill else FREE_ONE)
                    if len(events) >= self._fold_at:
                        self._fold_locked()
                    return
                self._settle_locked()
                counts = self._counts
                counts[N_FREES] += len(ids)
                if blocks.fill:
                    counts[FRAGMENTED] -= len(blocks.fill)
                self._history.append(tuple(counts))
            finally:
                self._lock.release()
            return
        objects = list(blocks)
        with self._lock:
            self._free_ids_locked([b.block_id for b in objects])
            self._record_history()
        for block in objects:
            if type(block) is PoolBlock:
                block._free_used = None  # (a value written while free is gone, as the seed's)
            else:
                block.owner = None
                block.n_used = 0

    def free_ids(self, block_ids: Iterable[int]) -> None:
        """free() by id, for callers that hold ids, not Block objects (the daemon). Already-free
        ids are skipped. The ids of one whole allocation of the ids path, in the order
        allocate_ids() or claim_ids() gave them, are freed at once, with no per-block work."""
        ids = block_ids if type(block_ids) is tuple else tuple(block_ids)
        # Found without the lock (one dict read): free() takes it, and frees by id if the
        # allocation was freed meanwhile, as if this call came after.
        chunk = self._chunk_of.get(ids[0]) if ids else None
        if (
            chunk is not None
            and chunk._blocks is None  # (a public allocation's list is the caller's)
            and not chunk.dead
            and not chunk.n_freed
            and chunk.block_ids == ids
        ):
            self.free(chunk)
            return
        with self._lock:
            self._free_ids_locked(ids)
            self._record_history()

    def _free_ids_locked(self, ids: Iterable[int]) -> None:
        self._settle_locked()
        if self._unindexed:
            self._index_locked()
        chunk_of = self._chunk_of
        free_lists = self._free
        counts = self._counts
        for block_id in ids:
            chunk = chunk_of.get(block_id)
            if chunk is None or chunk.dead:
                continue
            del chunk_of[block_id]  # (its Block, if any, reads as free from now on)
            fill = chunk.fill
            if fill and fill.pop(block_id, None) is not None:
                counts[FRAGMENTED] -= 1
            free = free_lists[chunk.stream]
            if free.claimed and block_id in free.claimed:
                free.claimed.discard(block_id)  # still listed where it was: free again there
            else:
                free.recycled.append(block_id)
            counts[N_FREES] += 1
            chunk.n_freed += 1
            if chunk.n_freed == len(chunk.block_ids):
                chunk.dead = True
                self._drop_chunk_locked(chunk)

    def _drop_chunk_locked(self, chunk: BlockList) -> None:
        """Forget an allocation none of whose blocks is held any more; with the owner's last
        one gone, release the owner, as the seed does."""
        owner = chunk.owner
        held = self._holdings[owner]
        if held is not chunk:  # one of several
            assert type(held) is not BlockList
            del held[id(chunk)]
            if held:
                return
        del self._holdings[owner]
        self._active_owners.discard(owner)

    def free_all(self, owner: Owner) -> None:
        """Free every block ``owner`` holds and release the owner id. O(blocks held)."""
        with self._lock:
            self._settle_locked()
            filed = self._holdings.pop(owner, None)
            if filed is not None:
                chunk_of = self._chunk_of
                counts = self._counts
                unindexed = self._unindexed
                for chunk in filed.values() if isinstance(filed, dict) else (filed,):
                    chunk.dead = True
                    if unindexed:
                        unindexed.pop(id(chunk), None)
                    free = self._free[chunk.stream]
                    held: Sequence[int] = chunk.block_ids
                    if chunk.n_freed:  # its blocks freed alone may be another's by now
                        held = [i for i in held if chunk_of.get(i) is chunk]
                    free.give_back(held)
                    if chunk.fill:
                        counts[FRAGMENTED] -= len(chunk.fill)
                    counts[N_FREES] += len(chunk.block_ids) - chunk.n_freed
            self._active_owners.discard(owner)
            self._record_history()

    # -- shrink and fill -------------------------------------------------------------------------

    def shrink(self, stream: str, target_free: int) -> int:
        """Retire free blocks of ``stream`` for good until at most ``target_free`` stay free.

        In-use blocks are never touched. Retired ids never come back, so a backing store may
        drop their buffers. Returns how many blocks were retired; a shrink that retired nothing
        leaves no history row (as the seed).

        Raises:
            ValueError: ``target_free`` < 0, or a stream this pool does not have.
        """
        if target_free < 0:
            raise ValueError(f"BlockPoolAllocator: target_free must be >= 0, got {target_free}")
        s = self._resolve_stream(stream)
        with self._lock:
            self._settle_locked()
            free = self._free[s]
            if free.claimed:
                free.unlist_claimed()
            n_free = len(free.recycled) + free.fresh_hi - free.fresh_lo
            n_retire = max(0, n_free - target_free)
            if n_retire:
                objects = self._block_objects
                for block_id in free.retire(n_retire):
                    self._chunk_of.pop(block_id, None)  # a stale entry of a freed allocation
                    if block_id < len(objects):
                        objects[block_id] = None  # the id never comes back: nor its Block
                self._counts[N_BLOCKS] -= n_retire
                self._counts[N_RETIRED] += n_retire
                self._record_history()  # as the seed: a shrink that retired nothing has no row
            return n_retire

    def mark_used(self, block: Block, n_used: int) -> None:
        """Set how many token slots of ``block`` are filled, keeping fragmentation exact.

        Use this instead of writing ``block.n_used``: the fragmentation count is kept
        incrementally, not recounted on every call. On a free block only the object changes.

        Raises:
            ValueError: ``n_used`` outside 0..block_size.
        """
        block_size = self._block_size
        if not 0 <= n_used <= block_size:
            raise ValueError(f"BlockPoolAllocator: n_used must be in 0..{block_size}, got {n_used}")
        self._lock.acquire()  # not "with": see allocate()
        try:
            self._mark_used_locked(block, n_used)
        finally:
            self._lock.release()

    def mark_used_many(self, updates: Iterable[tuple[Block, int]]) -> None:
        """mark_used() for several blocks; all values are checked before any is applied."""
        updates = list(updates)
        block_size = self._block_size
        for _, n_used in updates:
            if not 0 <= n_used <= block_size:
                raise ValueError(
                    f"BlockPoolAllocator: n_used must be in 0..{block_size}, got {n_used}"
                )
        with self._lock:
            for block, n_used in updates:
                self._mark_used_locked(block, n_used)

    def _mark_used_locked(self, block: Block, n_used: int) -> None:
        block_id = block.block_id
        if self._unindexed:
            self._index_locked()
        chunk = self._chunk_of.get(block_id)  # _live_chunk(), inlined: a decode step's call
        if chunk is not None and chunk.dead:
            chunk = None
        if type(block) is not PoolBlock:
            block.n_used = n_used
        elif chunk is None or block._chunk is not chunk:  # free: only the object changes
            block._free_used = (block._chunk, n_used)
        if chunk is None:
            return
        fill = chunk.fill
        was_partial = fill is not None and block_id in fill
        if n_used < self._block_size:
            if fill is None:
                fill = chunk.fill = {}
            fill[block_id] = n_used
            if was_partial:
                return
            code = FRAGMENT
        elif was_partial:
            assert fill is not None
            del fill[block_id]
            code = UNFRAGMENT
        else:
            return
        events = self._events  # the count, logged as allocate() logs its own
        events.append(code)
        if len(events) >= self._fold_at:
            self._fold_locked()

    def __repr__(self) -> str:
        return f"BlockPoolAllocator({self.stats!r})"
