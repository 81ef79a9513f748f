"""Fixed-size KV-cache block bookkeeping: which block ids are free, and which owner holds which.

This is the allocator the daemon serves to every worker, and the one a single process can use
directly. It holds no array data: a block id is an index that a backing store (see
``vqpool.worker.MLXBlockStorage``) maps to memory.

Behaviour follows the seed specification (``BlockPoolAllocator`` of VeloxQuant-MLX) call for
call: the same block ids in the same order, the same counters, the same errors. The
representation is different, because the seed's costs grew with the pool, with the order of
frees, and with every block it handed out:

* No object per free block. Each stream's free list is a stack of recycled ids on top of a
  never-used id range kept as two ints, so building a pool of a million blocks is O(1).
* One record per allocation: a ``BlockList`` (the ids, stream, format and owner they share);
  the only per-block bookkeeping is one dict write (block id -> its BlockList), done in C.
  ``allocate()`` returns that BlockList filled with its ``Block`` objects, a real ``list`` as
  the seed returns; what the caller does to the list never changes the allocator's record
  (``block_ids``). ``allocate_ids()`` (the daemon's path) builds no Block at all.
* Frees in any order are O(1) per block: a block is found through that dict, never searched for.
  ``free_all`` hands whole allocations back and leaves their dict entries behind, stale: an
  entry counts only while its allocation is not dead, and a new allocation overwrites it.
* History keeps a tuple of counters per mutating call; ``AllocationStats`` objects are built
  only when someone reads ``history``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import is_
from typing import TYPE_CHECKING, SupportsIndex

from vqpool.shared.errors import (
    BlockPoolExhaustedError,
    ClaimConflictError,
    OwnerAlreadyActiveError,
    VqpoolError,
)
from vqpool.shared.stats import AllocationStats

if TYPE_CHECKING:
    from vqpool.shared.pool import AllocationRequest, AllocationResult

# Token slots per block. Amortizes per-allocation overhead (as in vLLM/PagedAttention) while
# keeping the waste per sequence (at most block_size - 1 slots) small next to generation lengths.
DEFAULT_BLOCK_SIZE: int = 16

# Stats snapshots kept in ``history``. Bounded so a long-running daemon does not grow on its own
# bookkeeping; recent pressure is what tells exhaustion coming, not the lifetime record.
DEFAULT_HISTORY_SIZE: int = 256

Owner = int | str
"""An owner (request) id: opaque to the allocator, hashable. The daemon accepts ints and short
strings."""

# Positions of the counters in BlockPoolAllocator._counts: AllocationStats' field order, so a
# snapshot is AllocationStats(*counts) and a history row is tuple(counts).
(
    _N_BLOCKS,
    _N_ALLOCATIONS,
    _N_FREES,
    _N_REUSED,
    _N_EXHAUSTED,
    _N_GROWN,
    _N_RETIRED,
    _PEAK_IN_USE,
    _FRAGMENTED,
) = range(9)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_HISTORY_SIZE",
    "AllocationStats",
    "Block",
    "BlockList",
    "BlockPoolAllocator",
    "Owner",
    "PoolConfig",
]


@dataclass
class PoolConfig:
    """Configuration for a :class:`BlockPoolAllocator`.

    Attributes:
        block_size: Token slots stored per block.
        n_blocks: Blocks the pool manages initially. With ``separate_kv`` each of "k" and "v"
            gets ``n_blocks // 2``.
        separate_kv: Keys and values come from independent free lists ("k", "v") so K-heavy and
            V-heavy work never competes; False shares one list ("kv") for tighter packing.
        grow_on_exhaustion: An allocate() that would fail instead grows the exhausted stream by
            just the shortfall (up to ``max_blocks``).
        max_blocks: Cap on total blocks across streams once grown; None means no cap. Ignored
            unless ``grow_on_exhaustion``.
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    n_blocks: int = 1024
    separate_kv: bool = True
    grow_on_exhaustion: bool = False
    max_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"PoolConfig: block_size must be >= 1, got {self.block_size}")
        if self.n_blocks < 1:
            raise ValueError(f"PoolConfig: n_blocks must be >= 1, got {self.n_blocks}")
        if self.max_blocks is not None and self.max_blocks < self.n_blocks:
            raise ValueError(
                f"PoolConfig: max_blocks ({self.max_blocks}) must be >= n_blocks ({self.n_blocks})"
            )

    @property
    def streams(self) -> tuple[str, ...]:
        """The stream names this configuration has: ("k", "v") or ("kv",)."""
        return ("k", "v") if self.separate_kv else ("kv",)


@dataclass(slots=True)
class Block:
    """One allocated block of KV-cache storage, as :meth:`BlockPoolAllocator.allocate` gives it.

    The objects ``allocate()`` returned are kept up to date while the allocator changes their
    block (``mark_used``, ``free``, ``free_all``), as the seed's were; ``blocks_for`` gives fresh
    records of the current state. A block is always named by its id, so a copy (e.g. rebuilt
    from a wire message) acts on the same block as the original, and is updated itself when
    passed to ``mark_used`` or ``free``.

    Attributes:
        block_id: Index into the backing storage; stable for the pool's lifetime.
        stream: "k" or "v", or "kv" in a pool built with ``separate_kv=False``.
        format: Tag of the data format stored in the block (e.g. "fp16", "int4").
        n_used: Token slots occupied (<= block_size).
        owner: The owner id the block is checked out to, or None once free.
        ever_allocated: True once the block has been handed out.
    """

    block_id: int
    stream: str = "kv"
    format: str = "fp16"
    n_used: int = 0
    owner: Owner | None = None
    ever_allocated: bool = False


class BlockList(list[Block]):
    """The blocks one ``allocate()`` (or ``claim()``) call handed out, in order: a real
    ``list``, as the seed's ``allocate`` returns, and also the allocator's own record of that
    allocation (its "chunk"), so an allocation costs one object beside its Blocks.

    The list is filled with its ``Block`` objects before it is handed out, so every reader sees
    them, C code that reads a list's storage directly (msgpack, ``list.__len__``) included.

    The list belongs to the caller: every list operation works on it (``append``, ``extend``,
    ``pop``, ``sort``, slice assignment, ``+=``...) and changes only the list. The allocator's
    record is the rest: ``block_ids`` (the ids in allocation order, a tuple), ``stream``,
    ``format``, ``owner``, and what has been freed or filled since, so sorting or shortening
    the list never changes what the allocation holds, and ``free(blocks)`` frees exactly the
    blocks the list holds when it is called. Copies (``copy()``, ``blocks[:]``, ``copy.copy``,
    pickling) are plain lists of the same Block objects.

    Callers that need only ids (the daemon, which sends them over the wire) use
    :meth:`BlockPoolAllocator.allocate_ids` and ``claim_ids``: the record of such an allocation
    is a BlockList too, but its list stays empty, no Block is built, and it is never handed out.
    """

    __slots__ = (
        "_blocks",
        "_positions",
        "block_ids",
        "dead",
        "fill",
        "format",
        "n_freed",
        "owner",
        "stream",
    )

    def __init__(self, ids: tuple[int, ...], stream: str, format: str, owner: Owner) -> None:
        self.block_ids = ids
        self.stream = stream
        self.format = format
        self.owner = owner
        self.fill: dict[int, int] | None = None  # block id -> n_used, for blocks not full
        self.n_freed = 0  # blocks of this allocation freed one by one
        self.dead = False  # every block freed: map entries still naming this chunk are stale
        # The Block objects the allocator keeps in step, in allocation order (the list itself
        # may since have been reordered or changed by its caller); None on the ids path.
        self._blocks: list[Block] | None = None
        self._positions: dict[int, int] | None = None  # block id -> index in _blocks

    def _build_blocks(self, block_size: int) -> None:
        """Fill the list with one Block per id, as a new allocation holds it (full, but for
        the ``fill`` entries). Called once, by the allocator, before the list is handed out."""
        ids, fill = self.block_ids, self.fill
        stream, format, owner = self.stream, self.format, self.owner
        if len(ids) == 1:  # the commonest allocation (a decode step's next block): no loop
            bid = ids[0]
            n_used = fill.get(bid, block_size) if fill else block_size
            blocks = [Block(bid, stream, format, n_used, owner, True)]
        elif fill:
            blocks = [
                Block(bid, stream, format, fill.get(bid, block_size), owner, True) for bid in ids
            ]
        else:
            blocks = [Block(bid, stream, format, block_size, owner, True) for bid in ids]
        self._blocks = blocks
        self.extend(blocks)

    def _sync_block(self, block_id: int, n_used: int, freed: bool) -> None:
        """Keep a Block object this list handed out in step with the allocator, as the seed's
        shared objects were. Called by the allocator only when ``_blocks`` is set."""
        blocks = self._blocks
        assert blocks is not None, "no Block objects to keep in step"
        if len(blocks) == 1:
            block = blocks[0]
        else:
            positions = self._positions
            if positions is None:
                positions = self._positions = {bid: i for i, bid in enumerate(self.block_ids)}
            block = blocks[positions[block_id]]
        block.n_used = n_used
        if freed:
            block.owner = None

    def _sync_all_freed(self) -> None:
        for block in self._blocks or ():
            block.owner = None
            block.n_used = 0

    def __reduce_ex__(
        self, protocol: SupportsIndex
    ) -> tuple[type[list[Block]], tuple[list[Block]]]:
        # A copy or an unpickled list is not the allocation's record: a plain list of the blocks.
        return (list, (list(self),))


class _FreeList:
    """One stream's free blocks: a stack of recycled ids on top of a never-used id range.

    Reading the seed's free list bottom to top gives ``range(fresh_lo, fresh_hi)`` followed by
    ``recycled``; both hand out from the top, so the same ids come out in the same order.

    ``claimed`` holds ids that :meth:`BlockPoolAllocator.claim` took out of the middle of that
    list without moving anything (removing an id from the middle of a range or a stack is not
    O(1)): they are still listed but held, and are skipped when allocation or shrinking reaches
    them. Freed before that, such an id is simply free again at its old place. Empty except
    after a daemon restart's claims, so the hot paths pay one truth test for it.
    """

    __slots__ = ("claimed", "fresh_hi", "fresh_lo", "recycled", "recycled_index", "total")

    def __init__(self, lo: int, hi: int) -> None:
        self.fresh_lo = lo
        self.fresh_hi = hi
        self.recycled: list[int] = []
        self.claimed: set[int] = set()
        self.total = hi - lo
        # ``recycled`` as a set for claim(), with the key it was built at (see
        # BlockPoolAllocator._recycled_index_locked); None until a claim needs it.
        self.recycled_index: tuple[tuple[int, ...], set[int]] | None = None

    def n_free(self) -> int:
        return len(self.recycled) + self.fresh_hi - self.fresh_lo - len(self.claimed)

    def give_back(self, ids: Iterable[int]) -> None:
        """Put freed ids back: claimed ids are still listed, so they are free again in place."""
        claimed = self.claimed
        if not claimed:
            self.recycled.extend(ids)
            return
        append = self.recycled.append
        for block_id in ids:
            if block_id in claimed:
                claimed.discard(block_id)
            else:
                append(block_id)


class BlockPoolAllocator:
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

    def __init__(self, config: PoolConfig | None = None) -> None:
        self.config = config or PoolConfig()
        streams = self.config.streams
        per_stream = self.config.n_blocks // len(streams)
        self._streams = streams
        self._separate_kv = self.config.separate_kv
        self._block_size = self.config.block_size
        self._lock = threading.Lock()
        self._free: dict[str, _FreeList] = {
            s: _FreeList(i * per_stream, (i + 1) * per_stream) for i, s in enumerate(streams)
        }
        self._next_block_id = per_stream * len(streams)
        # Block id -> the allocation (chunk) it came from; an entry is live while
        # the chunk is not dead. Entries left by free_all() are stale and overwritten on reuse.
        self._chunk_of: dict[int, BlockList] = {}
        # Owner -> its live chunks in allocation order, keyed by id(chunk); an owner is here
        # while it holds a block.
        self._holdings: dict[Owner, dict[int, BlockList]] = {}
        self._active_owners: set[Owner] = set()
        # Ids on the recycled stack that were never handed out: added by growth, or moved off
        # the fresh range by _unlist_claimed_locked.
        self._grown_unused: set[int] = set()
        # The AllocationStats counters as a plain list: updates are list stores and a history
        # row is one C-level tuple() copy (a stats object's nine attributes cost ~6x that).
        self._counts = [self._next_block_id, 0, 0, 0, 0, 0, 0, 0, 0]
        self._history: deque[tuple[int, ...]] = deque(maxlen=DEFAULT_HISTORY_SIZE)

    # -- history -------------------------------------------------------------------------------

    def _record_history(self) -> None:
        self._history.append(tuple(self._counts))

    @property
    def stats(self) -> AllocationStats:
        """The counters now, as one consistent snapshot (taken under the lock, so never half
        way through another thread's update)."""
        with self._lock:
            return AllocationStats(*self._counts)

    @property
    def history(self) -> deque[AllocationStats]:
        """The last ``DEFAULT_HISTORY_SIZE`` stats snapshots, oldest first, one per mutating call
        (allocate, including a failed one; free; free_all; a shrink that retired blocks)."""
        with self._lock:
            rows = list(self._history)
        return deque((AllocationStats(*row) for row in rows), maxlen=DEFAULT_HISTORY_SIZE)

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
        with self._lock:
            return owner in self._active_owners

    def active_owners(self) -> list[Owner]:
        """Every active owner, including registered owners that hold no block."""
        with self._lock:
            return list(self._active_owners)

    def owners(self) -> list[Owner]:
        """Every owner that is active or holds blocks (release_owner() can leave an owner that
        holds blocks but is no longer active, as in the seed)."""
        with self._lock:
            return list(self._active_owners.union(self._holdings))

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
        return self._allocate_chunk(stream, n_tokens, owner, format, True)

    def allocate_ids(
        self, stream: str, n_tokens: int, owner: Owner, format: str = "fp16"
    ) -> tuple[int, ...]:
        """allocate() for callers that need only the ids (the daemon): the same allocation, the
        same errors, but no ``Block`` object is built. Free them with :meth:`free_ids`."""
        return self._allocate_chunk(stream, n_tokens, owner, format, False).block_ids

    def _allocate_chunk(
        self, stream: str, n_tokens: int, owner: Owner, format: str, with_blocks: bool
    ) -> BlockList:
        """allocate(): the new allocation's record, its list filled with Blocks if
        ``with_blocks`` (built before anything changes: building them can fail too)."""
        if n_tokens <= 0:
            raise ValueError(f"BlockPoolAllocator: n_tokens must be > 0, got {n_tokens}")
        if not self._separate_kv:
            stream = "kv"
        elif stream != "k" and stream != "v":
            raise ValueError(f"BlockPoolAllocator: stream must be 'k' or 'v', got {stream!r}")
        block_size = self._block_size
        n_needed = -(-n_tokens // block_size)
        # acquire/release rather than "with": on this hot path the context manager
        # protocol costs about as much as the bookkeeping itself.
        self._lock.acquire()
        try:
            free = self._free[stream]
            recycled = free.recycled
            claimed = free.claimed
            if len(recycled) + free.fresh_hi - free.fresh_lo - len(claimed) < n_needed:
                self._try_grow_locked(stream, n_needed)
                n_free = free.n_free()
                if n_free < n_needed:
                    self._active_owners.add(owner)  # an exhausted owner stays registered (seed)
                    self._counts[_N_EXHAUSTED] += 1
                    self._record_history()
                    raise BlockPoolExhaustedError(
                        f"BlockPoolAllocator: requested {n_needed} block(s) for stream "
                        f"{stream!r} but only {n_free} free (pool size {self._counts[_N_BLOCKS]})."
                    )
            # Choose the ids first, changing nothing: from the top, recycled ids first (LIFO),
            # then the fresh range downwards. The stack is cut to its first ``keep`` ids.
            n_listed = len(recycled)
            hi = free.fresh_hi
            passed: list[int] | None = None  # claimed ids met on the way: they leave the list
            if claimed:
                ids, n_reused, keep, new_hi, passed = self._plan_past_claimed_locked(free, n_needed)
                stack_top = recycled[keep:]
            else:
                n_reused = n_needed if n_needed <= n_listed else n_listed
                keep = n_listed - n_reused
                new_hi = hi - (n_needed - n_reused)
                if n_needed == 1:
                    ids = (recycled[-1],) if n_reused else (new_hi,)
                else:
                    taken = recycled[keep:]
                    taken.reverse()
                    if new_hi < hi:
                        taken.extend(range(hi - 1, new_hi - 1, -1))
                    ids = tuple(taken)
            chunk = BlockList(ids, stream, format, owner)
            last_used = n_tokens - (n_needed - 1) * block_size
            if last_used < block_size:
                chunk.fill = {ids[-1]: last_used}
            if with_blocks:
                chunk._build_blocks(block_size)
            active = self._active_owners
            was_active = owner in active
            grown_unused = self._grown_unused
            never_used = grown_unused.intersection(ids) if grown_unused and n_reused else None
            passed_unused = None
            if passed and grown_unused:
                passed_unused = grown_unused.intersection(passed)
            counts = self._counts
            peak = counts[_PEAK_IN_USE]
            counted = False
            # Then change everything; whatever is raised on the way is undone.
            try:
                if n_needed == 1:
                    self._chunk_of[ids[0]] = chunk
                else:
                    self._chunk_of.update(zip(ids, repeat(chunk)))
                chunks = self._holdings.get(owner)
                if chunks is None:
                    self._holdings[owner] = {id(chunk): chunk}
                else:
                    chunks[id(chunk)] = chunk
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
                        grown_unused -= passed_unused
                if never_used:
                    grown_unused -= never_used
                    n_reused -= len(never_used)
                if last_used < block_size:
                    counts[_FRAGMENTED] += 1
                counts[_N_ALLOCATIONS] += n_needed
                if n_reused:
                    counts[_N_REUSED] += n_reused
                in_use = counts[_N_ALLOCATIONS] - counts[_N_FREES]
                if in_use > peak:
                    counts[_PEAK_IN_USE] = in_use
                counted = True
                self._history.append(tuple(counts))
            except BaseException:
                self._undo_allocate_locked(chunk, was_active)
                if len(recycled) != n_listed:  # the stack was cut at ``keep``: put its top back
                    recycled.extend(stack_top if passed else reversed(ids[: n_listed - keep]))
                free.fresh_hi = hi
                if passed:
                    claimed.update(passed)
                grown_unused.update(never_used or (), passed_unused or ())
                if counted:
                    counts[_FRAGMENTED] -= last_used < block_size
                    counts[_N_ALLOCATIONS] -= n_needed
                    counts[_N_REUSED] -= n_reused
                    counts[_PEAK_IN_USE] = peak
                raise
            return chunk
        finally:
            self._lock.release()

    def _undo_allocate_locked(self, chunk: BlockList, was_active: bool) -> None:
        """Drop the allocation an interrupted allocate() was recording, whatever it got to: the
        map entries it wrote are stale once ``chunk`` is dead."""
        chunk.dead = True
        owner = chunk.owner
        chunks = self._holdings.get(owner)
        if chunks is not None and chunks.pop(id(chunk), None) is not None and not chunks:
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
        counted, as always, when an id is next allocated).

        Raises:
            ValueError: No ids, an id listed twice, ``fills`` not one value in 0..block_size per
                id, or a stream this pool does not have.
            ClaimConflictError: An id that is not free in ``stream``: held by an owner, retired
                by shrink, in another stream, or never part of this pool. Nothing was claimed.
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
            free = self._free[s]
            lo, hi, claimed = free.fresh_lo, free.fresh_hi, free.claimed
            recycled: set[int] | None = None  # built only if an id is not in the fresh range
            for block_id in ids:
                if lo <= block_id < hi and block_id not in claimed:
                    continue
                chunk = self._live_chunk(block_id)
                if chunk is not None or block_id in claimed:
                    holder = chunk.owner if chunk is not None else "another owner"
                    raise ClaimConflictError(
                        f"BlockPoolAllocator: block {block_id} is held by {holder!r}; "
                        "nothing was claimed"
                    )
                if recycled is None:
                    recycled = self._recycled_index_locked(free)
                if block_id not in recycled:
                    raise ClaimConflictError(
                        f"BlockPoolAllocator: block {block_id} is not a block of stream {s!r} "
                        f"in this pool (retired, another stream's, or beyond the pool's "
                        f"{self._counts[_N_BLOCKS]} blocks); nothing was claimed"
                    )
            chunk = BlockList(ids, s, format, owner)
            if fill:
                chunk.fill = fill
            if with_blocks:
                chunk._build_blocks(block_size)
            claimed.update(ids)
            holdings = self._holdings.get(owner)
            if holdings is None:
                self._holdings[owner] = {id(chunk): chunk}
            else:
                holdings[id(chunk)] = chunk
            self._chunk_of.update(zip(ids, repeat(chunk)))
            self._active_owners.add(owner)
            counts = self._counts
            counts[_FRAGMENTED] += len(fill)
            counts[_N_ALLOCATIONS] += len(ids)
            in_use = counts[_N_ALLOCATIONS] - counts[_N_FREES]
            counts[_PEAK_IN_USE] = max(counts[_PEAK_IN_USE], in_use)
            self._record_history()
            return chunk

    def _recycled_index_locked(self, free: _FreeList) -> set[int]:
        """The ids on ``free``'s recycled stack as a set, for claim(): built once and reused by
        the claims that follow, so that one claim message of thousands of one-id groups costs
        O(stack + ids), not O(stack x groups).

        Reused while nothing was added to the stack or retired from the pool since it was built,
        with no cost on the hot paths: an id joins the stack only by a free (the frees counter
        moves), a growth (the pool size moves) or, in shrink, a move off the never-used range
        (``fresh_hi`` moves); it leaves the pool only by a shrink (the retired counter moves).
        Anything else that takes an id off the stack hands it out, and claim() refuses a held id
        before it asks this set, so a set that still lists it is never wrong. Claims themselves
        move none of these, so they keep the set; the undo of a refused owner's claims counts
        as frees and costs one rebuild.
        """
        counts = self._counts
        key = (counts[_N_FREES], counts[_N_BLOCKS], counts[_N_RETIRED], free.fresh_hi)
        index = free.recycled_index
        if index is None or index[0] != key:
            index = free.recycled_index = (key, set(free.recycled))
        return index[1]

    def _unlist_claimed_locked(self, free: _FreeList) -> None:
        """Rewrite ``free`` so that it lists only free ids, keeping their order. O(stream).

        Needed before shrinking a stream with claimed ids in it: shrink retires whole slices off
        the top. Never-used ids moved from the fresh range onto the stack are remembered as
        never used, so their first allocation does not count as a reuse.
        """
        claimed = free.claimed
        in_fresh = [i for i in claimed if free.fresh_lo <= i < free.fresh_hi]
        moved: list[int] = []
        if in_fresh:
            lowest = min(in_fresh)
            moved = [i for i in range(lowest, free.fresh_hi) if i not in claimed]
            free.fresh_hi = lowest
            self._grown_unused.update(moved)
        self._grown_unused.difference_update(claimed)
        free.recycled[:] = [*moved, *(i for i in free.recycled if i not in claimed)]
        claimed.clear()

    def _plan_past_claimed_locked(
        self, free: _FreeList, n: int
    ) -> tuple[tuple[int, ...], int, int, int, list[int]]:
        """The ``n`` ids allocate() takes from the top of ``free``, past the claimed ids met on
        the way (they are held: once out of the list, a free appends them as usual); changes
        nothing. Returns the ids, how many come from the recycled stack, how many ids of the
        stack stay, the new top of the fresh range, and the claimed ids passed."""
        claimed = free.claimed
        recycled = free.recycled
        taken: list[int] = []
        passed: list[int] = []
        n_reused = 0
        keep = len(recycled)
        hi = free.fresh_hi
        while len(taken) < n:
            if keep:
                keep -= 1
                block_id = recycled[keep]
                if block_id in claimed:
                    passed.append(block_id)
                    continue
                n_reused += 1
            else:
                hi -= 1
                block_id = hi
                if block_id in claimed:
                    passed.append(block_id)
                    continue
            taken.append(block_id)
        return tuple(taken), n_reused, keep, hi, passed

    def _try_grow_locked(self, stream: str, n_needed: int) -> None:
        """Add blocks to ``stream`` to cover its shortfall for ``n_needed``, if allowed."""
        if not self.config.grow_on_exhaustion:
            return
        free = self._free[stream]
        n_short = n_needed - free.n_free()
        if self.config.max_blocks is not None:
            n_short = min(n_short, self.config.max_blocks - self._counts[_N_BLOCKS])
        if n_short <= 0:
            return
        first = self._next_block_id
        new_ids = range(first, first + n_short)
        recycled = free.recycled
        n_listed = len(recycled)
        try:
            recycled.extend(new_ids)
            self._grown_unused.update(new_ids)
        except BaseException:  # all or nothing: a growth cut short leaves no id behind
            if len(recycled) != n_listed:
                del recycled[n_listed:]
            self._grown_unused.difference_update(new_ids)
            raise
        self._next_block_id = first + n_short
        free.total += n_short
        self._counts[_N_BLOCKS] += n_short
        self._counts[_N_GROWN] += n_short

    # -- free ------------------------------------------------------------------------------------

    def _live_chunk(self, block_id: int) -> BlockList | None:
        chunk = self._chunk_of.get(block_id)
        if chunk is None or chunk.dead:
            return None
        return chunk

    def free(self, blocks: Iterable[Block]) -> None:
        """Return blocks to their stream's free list. Already-free blocks are skipped.

        Blocks are found by id, so freeing a copy frees the block; each Block object passed is
        marked free (owner None, n_used 0), as the seed's shared objects were. A list allocate()
        returned frees what it lists now, whatever its caller changed in it.
        """
        # An allocation's own list still holding just the Block objects built for it (same
        # objects, same order: an O(len) check in C) is the whole allocation.
        if (
            type(blocks) is BlockList
            and blocks._blocks is not None
            and len(blocks) == len(blocks._blocks)
            and all(map(is_, blocks, blocks._blocks))
        ):
            self._lock.acquire()  # not "with": see allocate()
            try:
                self._free_chunk_locked(blocks)
            finally:
                self._lock.release()
            return
        objects = list(blocks)
        with self._lock:
            self._free_ids_locked([b.block_id for b in objects])
            self._record_history()
        for block in objects:
            block.owner = None
            block.n_used = 0

    def free_ids(self, block_ids: Iterable[int]) -> None:
        """free() by id, for callers that hold ids, not Block objects (the daemon). Already-free
        ids are skipped. The ids of one whole allocation, in the order allocate_ids() or
        claim_ids() gave them, are freed at once, with no per-block work."""
        ids = block_ids if type(block_ids) is tuple else tuple(block_ids)
        self._lock.acquire()  # not "with": see allocate()
        try:
            chunk = self._chunk_of.get(ids[0]) if ids else None
            # Not dead and nothing freed alone: every id of the chunk is still held by it.
            if (
                chunk is not None
                and not chunk.dead
                and not chunk.n_freed
                and chunk.block_ids == ids
            ):
                self._free_chunk_locked(chunk)
                return
            self._free_ids_locked(ids)
            self._record_history()
        finally:
            self._lock.release()

    def _free_chunk_locked(self, chunk: BlockList) -> None:
        """Free every block an allocation still holds, and record one history row."""
        if chunk.dead or chunk.n_freed:
            self._free_ids_locked(chunk.block_ids)
            self._record_history()
            return
        # The common case: a whole live allocation none of whose blocks was freed alone. No
        # per-block bookkeeping: its map entries just go stale.
        chunk.dead = True
        if chunk._blocks is not None:
            chunk._sync_all_freed()
        ids = chunk.block_ids
        free = self._free[chunk.stream]
        if free.claimed:
            free.give_back(ids)
        else:
            free.recycled.extend(ids)
        # _drop_chunk_locked(chunk), inlined: the call alone is 3% of allocate+free.
        owner = chunk.owner
        chunks = self._holdings[owner]
        del chunks[id(chunk)]
        if not chunks:
            del self._holdings[owner]
            self._active_owners.discard(owner)
        counts = self._counts
        counts[_N_FREES] += len(ids)
        if chunk.fill:
            counts[_FRAGMENTED] -= len(chunk.fill)
        self._history.append(tuple(counts))

    def _free_ids_locked(self, ids: Iterable[int]) -> None:
        chunk_of = self._chunk_of
        free_lists = self._free
        counts = self._counts
        for block_id in ids:
            chunk = chunk_of.get(block_id)
            if chunk is None or chunk.dead:
                continue
            del chunk_of[block_id]
            if chunk._blocks is not None:
                chunk._sync_block(block_id, 0, freed=True)
            fill = chunk.fill
            if fill and fill.pop(block_id, None) is not None:
                counts[_FRAGMENTED] -= 1
            free = free_lists[chunk.stream]
            if free.claimed and block_id in free.claimed:
                free.claimed.discard(block_id)  # still listed where it was: free again there
            else:
                free.recycled.append(block_id)
            counts[_N_FREES] += 1
            chunk.n_freed += 1
            if chunk.n_freed == len(chunk.block_ids):
                chunk.dead = True
                self._drop_chunk_locked(chunk)

    def _drop_chunk_locked(self, chunk: BlockList) -> None:
        """Forget an allocation none of whose blocks is held any more; with the owner's last
        one gone, release the owner, as the seed does."""
        owner = chunk.owner
        chunks = self._holdings[owner]
        del chunks[id(chunk)]
        if not chunks:
            del self._holdings[owner]
            self._active_owners.discard(owner)

    def free_all(self, owner: Owner) -> None:
        """Free every block ``owner`` holds and release the owner id. O(blocks held)."""
        with self._lock:
            chunks = self._holdings.pop(owner, None)
            if chunks is not None:
                chunk_of = self._chunk_of
                counts = self._counts
                for chunk in chunks.values():
                    chunk.dead = True
                    if chunk._blocks is not None:
                        chunk._sync_all_freed()
                    free = self._free[chunk.stream]
                    if chunk.n_freed:
                        free.give_back([i for i in chunk.block_ids if chunk_of.get(i) is chunk])
                    else:
                        free.give_back(chunk.block_ids)
                    if chunk.fill:
                        counts[_FRAGMENTED] -= len(chunk.fill)
                    counts[_N_FREES] += len(chunk.block_ids) - chunk.n_freed
            self._active_owners.discard(owner)
            self._record_history()

    # -- reads -----------------------------------------------------------------------------------

    def blocks_for(self, owner: Owner) -> list[Block]:
        """Records of the blocks ``owner`` holds now, in allocation order."""
        with self._lock:
            chunk_of = self._chunk_of
            size = self._block_size
            return [
                Block(
                    bid, chunk.stream, chunk.format, (chunk.fill or {}).get(bid, size), owner, True
                )
                for chunk in self._holdings.get(owner, {}).values()
                for bid in chunk.block_ids
                if chunk_of.get(bid) is chunk
            ]

    def usage(self, owner: Owner) -> dict[str, tuple[int, int]]:
        """Per stream, how many blocks ``owner`` holds and how many token slots of them are
        used. O(allocations the owner holds), no Block objects: for admin views and metrics."""
        with self._lock:
            size = self._block_size
            usage: dict[str, tuple[int, int]] = {}
            for chunk in self._holdings.get(owner, {}).values():
                n_held = len(chunk.block_ids) - chunk.n_freed
                unused = sum(size - n for n in chunk.fill.values()) if chunk.fill else 0
                n_blocks, n_tokens = usage.get(chunk.stream, (0, 0))
                usage[chunk.stream] = (n_blocks + n_held, n_tokens + n_held * size - unused)
            return usage

    def n_blocks_for(self, owner: Owner) -> int:
        """How many blocks ``owner`` holds now."""
        with self._lock:
            chunks = self._holdings.get(owner, {})
            return sum(len(c.block_ids) - c.n_freed for c in chunks.values())

    def stream_of(self, block_id: int) -> str | None:
        """The stream of ``block_id`` while it is allocated, else None (the daemon's budget
        prices a freed block by its stream)."""
        with self._lock:
            chunk = self._live_chunk(block_id)
            return None if chunk is None else chunk.stream

    def owner_of(self, block_id: int) -> Owner | None:
        """The owner holding ``block_id``, or None if it is free, retired or never existed."""
        with self._lock:
            chunk = self._live_chunk(block_id)
            return None if chunk is None else chunk.owner

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
            free = self._free[s]
            if free.claimed:
                self._unlist_claimed_locked(free)
            n_free = len(free.recycled) + free.fresh_hi - free.fresh_lo
            n_retire = max(0, n_free - target_free)
            if n_retire:
                from_recycled = min(n_retire, len(free.recycled))
                if from_recycled:
                    retired_ids = free.recycled[-from_recycled:]
                    del free.recycled[-from_recycled:]
                    self._grown_unused.difference_update(retired_ids)
                    for block_id in retired_ids:
                        self._chunk_of.pop(block_id, None)
                free.fresh_hi -= n_retire - from_recycled
                free.total -= n_retire
                self._counts[_N_BLOCKS] -= n_retire
                self._counts[_N_RETIRED] += n_retire
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
        with self._lock:
            self._mark_used_locked(block, n_used)

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
        block.n_used = n_used
        block_id = block.block_id
        chunk = self._live_chunk(block_id)
        if chunk is None:
            return
        if chunk._blocks is not None:
            chunk._sync_block(block_id, n_used, freed=False)
        fill = chunk.fill
        was_partial = fill is not None and block_id in fill
        if n_used < self._block_size:
            if fill is None:
                fill = chunk.fill = {}
            fill[block_id] = n_used
            self._counts[_FRAGMENTED] += not was_partial
        elif was_partial:
            assert fill is not None
            del fill[block_id]
            self._counts[_FRAGMENTED] -= 1

    # -- audit -----------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Recount everything and raise AssertionError on the first disagreement.

        O(pool size): for tests and admin audits, never for a hot path.
        """
        with self._lock:
            held: dict[int, BlockList] = {}
            n_partial = 0
            for owner, chunks in self._holdings.items():
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
            seen_listed: set[int] = set()
            for s, free in self._free.items():
                listed = [*range(free.fresh_lo, free.fresh_hi), *free.recycled]
                assert len(set(listed)) == len(listed), f"stream {s!r}: an id is free twice"
                assert free.claimed <= set(listed), f"stream {s!r}: a claimed id is not listed"
                assert free.claimed <= held.keys(), f"stream {s!r}: a claimed id is not held"
                ids = [i for i in listed if i not in free.claimed]
                seen_listed.update(listed)
                in_use = sum(1 for c in held.values() if c.stream == s)
                assert len(ids) + in_use == free.total, (
                    f"stream {s!r}: free {len(ids)} + in use {in_use} != total {free.total}"
                )
                assert seen_free.isdisjoint(ids), f"stream {s!r}: an id is free in two streams"
                seen_free.update(ids)
            assert seen_free.isdisjoint(held), "a block is both free and held"
            assert self._grown_unused <= seen_listed, "a never-used id is not listed as free"

            st = AllocationStats(*self._counts)
            assert st._fragmented_count == n_partial, (
                f"fragmented count {st._fragmented_count} != recount {n_partial}"
            )
            assert st.blocks_in_use() == len(held), (
                f"blocks_in_use {st.blocks_in_use()} != recount {len(held)}"
            )
            total = sum(free.total for free in self._free.values())
            assert st.n_blocks == total, f"n_blocks {st.n_blocks} != recount {total}"

    def __repr__(self) -> str:
        return f"BlockPoolAllocator({self.stats!r})"
