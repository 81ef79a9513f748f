"""Fixed-size KV-cache block bookkeeping: which block ids are free, and which owner holds which.

This is the allocator the daemon serves to every worker, and the one a single process can use
directly. It holds no array data: a block id is an index that a backing store (see
``vqpool.worker.MLXBlockStorage``) maps to memory.

Behaviour follows the seed specification (``BlockPoolAllocator`` of VeloxQuant-MLX) call for
call: the same block ids in the same order, the same counters, the same errors. The
representation is different, because the seed's costs grew with the pool and with the order of
frees:

* No object per free block. Each stream's free list is a stack of recycled ids on top of a
  never-used id range kept as two ints, so building a pool of a million blocks is O(1) and
  popping from the "bottom" of the seed's list is popping from the top of that range.
* A ``Block`` object exists only while its block is allocated (``_allocated`` maps id -> Block),
  so memory follows what is in use, not what could be.
* Each owner's blocks are an insertion-ordered dict used as an ordered set, so ``free`` of any
  subset in any order is O(1) per block (the seed's ``list.remove`` made it quadratic).
* History keeps a tuple of counters per mutating call and builds ``AllocationStats`` objects
  only when someone reads ``history``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vqpool.shared.errors import BlockPoolExhaustedError, OwnerAlreadyActiveError, VqpoolError

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

    The allocator keeps this object up to date while the block is allocated (``mark_used``,
    ``free``); once freed, it is a record of the past and the allocator forgets it.

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


@dataclass(slots=True)
class AllocationStats:
    """Running counters for a :class:`BlockPoolAllocator`, cumulative since construction.

    Attributes:
        n_blocks: Blocks the pool manages now.
        n_allocations: Blocks handed out by successful allocate() calls.
        n_frees: Blocks returned by free()/free_all().
        n_reused: Allocated blocks that had been handed out before (not fresh ids).
        n_exhausted: allocate() calls that failed for want of free blocks.
        n_grown: Blocks added by exhaustion-triggered growth.
        n_retired: Blocks removed for good by shrink().
        peak_blocks_in_use: High-water mark of blocks allocated at once.
    """

    n_blocks: int
    n_allocations: int = 0
    n_frees: int = 0
    n_reused: int = 0
    n_exhausted: int = 0
    n_grown: int = 0
    n_retired: int = 0
    peak_blocks_in_use: int = 0
    _fragmented_count: int = field(default=0, repr=False)

    def blocks_in_use(self) -> int:
        """Blocks allocated now."""
        return self.n_allocations - self.n_frees

    def fragmentation(self) -> float:
        """Fraction of the pool's blocks that are allocated but not full (0.0 for no blocks)."""
        if self.n_blocks == 0:
            return 0.0
        return self._fragmented_count / self.n_blocks

    def snapshot(self) -> AllocationStats:
        """An independent copy, for history and export."""
        return AllocationStats(
            self.n_blocks,
            self.n_allocations,
            self.n_frees,
            self.n_reused,
            self.n_exhausted,
            self.n_grown,
            self.n_retired,
            self.peak_blocks_in_use,
            self._fragmented_count,
        )

    def to_prometheus(self, prefix: str = "veloxquant_block_pool") -> str:
        """These stats in the Prometheus text exposition format, newline-terminated.

        The metric names, types and order are the seed's, so existing dashboards keep working.
        """
        gauges = (
            ("blocks_in_use", str(self.blocks_in_use())),
            ("blocks_total", str(self.n_blocks)),
            ("fragmentation", f"{self.fragmentation():.6f}"),
            ("peak_blocks_in_use", str(self.peak_blocks_in_use)),
        )
        counters = (
            ("allocations_total", self.n_allocations),
            ("frees_total", self.n_frees),
            ("reused_total", self.n_reused),
            ("exhausted_total", self.n_exhausted),
            ("grown_total", self.n_grown),
            ("retired_total", self.n_retired),
        )
        lines: list[str] = []
        for name, text in gauges:
            lines += [f"# TYPE {prefix}_{name} gauge", f"{prefix}_{name} {text}"]
        for name, value in counters:
            lines += [f"# TYPE {prefix}_{name} counter", f"{prefix}_{name} {value}"]
        return "\n".join(lines) + "\n"

    def __repr__(self) -> str:
        return (
            f"AllocationStats(in_use={self.blocks_in_use()}/{self.n_blocks}, "
            f"allocations={self.n_allocations}, frees={self.n_frees}, "
            f"reused={self.n_reused}, exhausted={self.n_exhausted}, "
            f"grown={self.n_grown}, retired={self.n_retired}, "
            f"peak={self.peak_blocks_in_use}, fragmentation={self.fragmentation():.3f})"
        )


class _FreeList:
    """One stream's free blocks: a stack of recycled ids on top of a never-used id range.

    Reading the seed's free list bottom to top gives ``range(fresh_lo, fresh_hi)`` followed by
    ``recycled``; both hand out from the top, so the same ids come out in the same order.
    """

    __slots__ = ("fresh_hi", "fresh_lo", "recycled", "total")

    def __init__(self, lo: int, hi: int) -> None:
        self.fresh_lo = lo
        self.fresh_hi = hi
        self.recycled: list[int] = []
        self.total = hi - lo

    def __len__(self) -> int:
        return len(self.recycled) + self.fresh_hi - self.fresh_lo


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
        self._lock = threading.Lock()
        self._free: dict[str, _FreeList] = {
            s: _FreeList(i * per_stream, (i + 1) * per_stream) for i, s in enumerate(streams)
        }
        self._next_block_id = per_stream * len(streams)
        self._allocated: dict[int, Block] = {}
        self._owner_blocks: dict[Owner, dict[int, None]] = {}
        self._active_owners: set[Owner] = set()
        # Ids added by growth sit on the recycled stack without having been handed out yet.
        self._grown_unused: set[int] = set()
        self.stats = AllocationStats(n_blocks=self._next_block_id)
        self._history: deque[tuple[int, ...]] = deque(maxlen=DEFAULT_HISTORY_SIZE)

    # -- history -------------------------------------------------------------------------------

    def _record_history(self) -> None:
        st = self.stats
        self._history.append(
            (
                st.n_blocks,
                st.n_allocations,
                st.n_frees,
                st.n_reused,
                st.n_exhausted,
                st.n_grown,
                st.n_retired,
                st.peak_blocks_in_use,
                st._fragmented_count,
            )
        )

    @property
    def history(self) -> deque[AllocationStats]:
        """The last ``DEFAULT_HISTORY_SIZE`` stats snapshots, oldest first, one per mutating call
        (allocate, including a failed one; free; free_all; shrink)."""
        with self._lock:
            rows = list(self._history)
        return deque((AllocationStats(*row) for row in rows), maxlen=DEFAULT_HISTORY_SIZE)

    # -- streams and owners ----------------------------------------------------------------------

    @property
    def streams(self) -> tuple[str, ...]:
        """The streams of this pool: ("k", "v") or ("kv",)."""
        return self._streams

    def _resolve_stream(self, stream: str) -> str:
        if not self.config.separate_kv:
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
            return list(self._active_owners.union(self._owner_blocks))

    # -- allocate --------------------------------------------------------------------------------

    def allocate(
        self, stream: str, n_tokens: int, owner: Owner, format: str = "fp16"
    ) -> list[Block]:
        """Allocate ceil(n_tokens / block_size) blocks to ``owner``, all or nothing.

        Every block is full except possibly the last, which holds the remainder. A repeated call
        for an active owner adds to what it holds (a request growing).

        Raises:
            ValueError: ``n_tokens`` <= 0, or a stream this pool does not have.
            BlockPoolExhaustedError: Too few free blocks and no room to grow; nothing allocated
                (the owner stays registered, as in the seed).
        """
        if n_tokens <= 0:
            raise ValueError(f"BlockPoolAllocator: n_tokens must be > 0, got {n_tokens}")
        s = self._resolve_stream(stream)
        block_size = self.config.block_size
        n_needed = -(-n_tokens // block_size)
        with self._lock:
            if owner not in self._active_owners:
                self._register_owner_locked(owner)
            free = self._free[s]
            if len(free) < n_needed:
                self._try_grow_locked(s, n_needed - len(free))
                if len(free) < n_needed:
                    self.stats.n_exhausted += 1
                    self._record_history()
                    raise BlockPoolExhaustedError(
                        f"BlockPoolAllocator: requested {n_needed} block(s) for stream {s!r} but "
                        f"only {len(free)} free (pool size {self.stats.n_blocks})."
                    )
            ids, n_reused = self._pop_free_locked(free, n_needed)
            owned = self._owner_blocks.get(owner)
            if owned is None:
                owned = self._owner_blocks[owner] = {}
            allocated = self._allocated
            last_used = n_tokens - (n_needed - 1) * block_size
            blocks = [Block(bid, s, format, block_size, owner, True) for bid in ids]
            blocks[-1].n_used = last_used
            for block in blocks:
                allocated[block.block_id] = block
                owned[block.block_id] = None
            st = self.stats
            st.n_allocations += n_needed
            st.n_reused += n_reused
            if last_used < block_size:
                st._fragmented_count += 1
            in_use = st.n_allocations - st.n_frees
            if in_use > st.peak_blocks_in_use:
                st.peak_blocks_in_use = in_use
            self._record_history()
            return blocks

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

    def _pop_free_locked(self, free: _FreeList, n: int) -> tuple[list[int], int]:
        """Take ``n`` ids off the top of ``free``; also return how many had been used before."""
        recycled = free.recycled
        n_recycled = min(n, len(recycled))
        ids: list[int] = []
        n_reused = n_recycled
        if n_recycled:
            ids = recycled[-n_recycled:]
            ids.reverse()
            del recycled[-n_recycled:]
            if self._grown_unused:
                fresh_grown = self._grown_unused.intersection(ids)
                self._grown_unused -= fresh_grown
                n_reused -= len(fresh_grown)
        n_fresh = n - n_recycled
        if n_fresh:
            hi = free.fresh_hi
            ids.extend(range(hi - 1, hi - 1 - n_fresh, -1))
            free.fresh_hi = hi - n_fresh
        return ids, n_reused

    def _try_grow_locked(self, stream: str, n_short: int) -> None:
        """Add blocks to ``stream`` to cover an ``n_short`` shortfall, if the config allows."""
        if not self.config.grow_on_exhaustion:
            return
        if self.config.max_blocks is not None:
            headroom = self.config.max_blocks - self.stats.n_blocks
            if headroom <= 0:
                return
            n_short = min(n_short, headroom)
        if n_short <= 0:
            return
        first = self._next_block_id
        new_ids = range(first, first + n_short)
        self._next_block_id = first + n_short
        free = self._free[stream]
        free.recycled.extend(new_ids)
        free.total += n_short
        self._grown_unused.update(new_ids)
        self.stats.n_blocks += n_short
        self.stats.n_grown += n_short

    # -- free ------------------------------------------------------------------------------------

    def free(self, blocks: Iterable[Block]) -> None:
        """Return blocks to their stream's free list. Already-free blocks are skipped.

        A block is found by its id, so a copy of a Block (e.g. rebuilt from a wire message) frees
        the same block the original would.
        """
        with self._lock:
            self._free_locked(blocks)
            self._record_history()

    def _free_locked(self, blocks: Iterable[Block]) -> None:
        allocated = self._allocated
        owner_blocks = self._owner_blocks
        block_size = self.config.block_size
        st = self.stats
        for block in blocks:
            live = allocated.pop(block.block_id, None)
            if live is None:
                continue
            owner = live.owner
            assert owner is not None, f"allocated block {live.block_id} has no owner"
            owned = owner_blocks[owner]
            del owned[live.block_id]
            if not owned:
                del owner_blocks[owner]
                self._active_owners.discard(owner)
            if live.n_used < block_size:
                st._fragmented_count -= 1
            live.owner = None
            live.n_used = 0
            if block is not live:
                block.owner = None
                block.n_used = 0
            self._free[live.stream].recycled.append(live.block_id)
            st.n_frees += 1

    def free_all(self, owner: Owner) -> None:
        """Free every block ``owner`` holds and release the owner id. O(blocks held)."""
        with self._lock:
            block_ids = self._owner_blocks.pop(owner, None)
            if block_ids:
                allocated = self._allocated
                block_size = self.config.block_size
                n_partial = 0
                for block_id in block_ids:
                    block = allocated.pop(block_id)
                    if block.n_used < block_size:
                        n_partial += 1
                    block.owner = None
                    block.n_used = 0
                    self._free[block.stream].recycled.append(block_id)
                st = self.stats
                st._fragmented_count -= n_partial
                st.n_frees += len(block_ids)
            self._active_owners.discard(owner)
            self._record_history()

    # -- reads -----------------------------------------------------------------------------------

    def blocks_for(self, owner: Owner) -> list[Block]:
        """The blocks ``owner`` holds now, in allocation order."""
        with self._lock:
            allocated = self._allocated
            return [allocated[bid] for bid in self._owner_blocks.get(owner, ())]

    def n_blocks_for(self, owner: Owner) -> int:
        """How many blocks ``owner`` holds now."""
        with self._lock:
            return len(self._owner_blocks.get(owner, ()))

    def owner_of(self, block_id: int) -> Owner | None:
        """The owner holding ``block_id``, or None if it is free, retired or never existed."""
        with self._lock:
            block = self._allocated.get(block_id)
            return None if block is None else block.owner

    def n_free(self, stream: str = "k") -> int:
        """Free blocks left in ``stream``."""
        s = self._resolve_stream(stream)
        with self._lock:
            return len(self._free[s])

    def n_total(self, stream: str = "k") -> int:
        """Blocks ``stream`` manages now (free plus in use)."""
        s = self._resolve_stream(stream)
        with self._lock:
            return self._free[s].total

    # -- shrink and fill -------------------------------------------------------------------------

    def shrink(self, stream: str, target_free: int) -> int:
        """Retire free blocks of ``stream`` for good until at most ``target_free`` stay free.

        In-use blocks are never touched. Retired ids never come back, so a backing store may
        drop their buffers. Returns how many blocks were retired.

        Raises:
            ValueError: ``target_free`` < 0, or a stream this pool does not have.
        """
        if target_free < 0:
            raise ValueError(f"BlockPoolAllocator: target_free must be >= 0, got {target_free}")
        s = self._resolve_stream(stream)
        with self._lock:
            free = self._free[s]
            n_retire = max(0, len(free) - target_free)
            if n_retire:
                from_recycled = min(n_retire, len(free.recycled))
                if from_recycled:
                    retired_ids = free.recycled[-from_recycled:]
                    del free.recycled[-from_recycled:]
                    self._grown_unused.difference_update(retired_ids)
                free.fresh_hi -= n_retire - from_recycled
                free.total -= n_retire
                self.stats.n_blocks -= n_retire
                self.stats.n_retired += n_retire
            self._record_history()
            return n_retire

    def mark_used(self, block: Block, n_used: int) -> None:
        """Set how many token slots of ``block`` are filled, keeping fragmentation exact.

        Use this instead of writing ``block.n_used``: the fragmentation count is kept
        incrementally, not recounted on every call. On a free block only the object changes.

        Raises:
            ValueError: ``n_used`` outside 0..block_size.
        """
        block_size = self.config.block_size
        if not 0 <= n_used <= block_size:
            raise ValueError(f"BlockPoolAllocator: n_used must be in 0..{block_size}, got {n_used}")
        with self._lock:
            live = self._allocated.get(block.block_id)
            if live is None:
                block.n_used = n_used
                return
            was_partial = live.n_used < block_size
            live.n_used = n_used
            block.n_used = n_used
            is_partial = n_used < block_size
            if is_partial != was_partial:
                self.stats._fragmented_count += 1 if is_partial else -1

    def mark_used_many(self, updates: Sequence[tuple[Block, int]]) -> None:
        """mark_used() for several blocks; all values are checked before any is applied."""
        block_size = self.config.block_size
        for _, n_used in updates:
            if not 0 <= n_used <= block_size:
                raise ValueError(
                    f"BlockPoolAllocator: n_used must be in 0..{block_size}, got {n_used}"
                )
        for block, n_used in updates:
            self.mark_used(block, n_used)

    # -- audit -----------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Recount everything and raise AssertionError on the first disagreement.

        O(pool size): for tests and admin audits, never for a hot path.
        """
        with self._lock:
            block_size = self.config.block_size
            seen_free: set[int] = set()
            for s, free in self._free.items():
                ids = [*range(free.fresh_lo, free.fresh_hi), *free.recycled]
                assert len(set(ids)) == len(ids), f"stream {s!r}: an id is free twice"
                in_use = sum(1 for b in self._allocated.values() if b.stream == s)
                assert len(free) + in_use == free.total, (
                    f"stream {s!r}: free {len(free)} + in use {in_use} != total {free.total}"
                )
                assert seen_free.isdisjoint(ids), f"stream {s!r}: an id is free in two streams"
                seen_free.update(ids)
            assert seen_free.isdisjoint(self._allocated), "a block is both free and allocated"
            holders: dict[int, Owner] = {}
            for owner, owned in self._owner_blocks.items():
                assert owned, f"owner {owner!r} has an empty block list"
                for bid in owned:
                    assert bid not in holders, (
                        f"block {bid} is in the lists of {holders[bid]!r} and {owner!r}"
                    )
                    holders[bid] = owner
            assert holders.keys() == self._allocated.keys(), "owner lists != allocated blocks"
            for bid, block in self._allocated.items():
                assert block.owner == holders[bid], f"block {bid} names {block.owner!r}"
                assert 0 <= block.n_used <= block_size, f"block {bid} n_used {block.n_used}"
            st = self.stats
            partial = sum(1 for b in self._allocated.values() if b.n_used < block_size)
            assert st._fragmented_count == partial, (
                f"fragmented count {st._fragmented_count} != recount {partial}"
            )
            assert st.blocks_in_use() == len(self._allocated), (
                f"blocks_in_use {st.blocks_in_use()} != recount {len(self._allocated)}"
            )
            total = sum(free.total for free in self._free.values())
            assert st.n_blocks == total, f"n_blocks {st.n_blocks} != recount {total}"
            assert self._grown_unused <= seen_free, "a grown-unused id is not free"

    def __repr__(self) -> str:
        return f"BlockPoolAllocator({self.stats!r})"
