"""A deliberately simple model of the seed allocator's behaviour, for model-based tests.

Plain lists and dicts, one record per block, no attention to speed: what it does is easy to check
by reading it against the seed specification. The state machine in test_allocator_model.py runs
the real allocator and this model side by side and compares every result.

``claim`` (not in the seed) takes specific ids without moving them in the free list: a claimed
id stays listed as a placeholder, skipped (and dropped) when allocation or shrink reaches it, and
free again at its old place if it is freed first. In a pool that grows, a claimed id beyond the
pool, within ``max_blocks``, grows the pool to hold it (a restart of a grown pool): the ids
skipped on the way are the *gap*, part of no stream until a claim names them or a growth hands
them out, lowest first, before any new id.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vqpool.shared import Owner, PoolConfig


@dataclass
class RefBlock:
    stream: str
    owner: Owner | None = None
    n_used: int = 0
    format: str = "fp16"
    ever_allocated: bool = False


@dataclass
class RefCounters:
    n_blocks: int
    n_allocations: int = 0
    n_frees: int = 0
    n_reused: int = 0
    n_exhausted: int = 0
    n_grown: int = 0
    n_retired: int = 0
    peak_blocks_in_use: int = 0
    history: list[tuple[int, ...]] = field(default_factory=list)


class ReferencePool:
    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.streams = ("k", "v") if config.separate_kv else ("kv",)
        per_stream = config.n_blocks // len(self.streams)
        self.blocks: dict[int, RefBlock] = {}
        self.free: dict[str, list[int]] = {}
        next_id = 0
        for s in self.streams:
            self.free[s] = list(range(next_id, next_id + per_stream))
            for bid in self.free[s]:
                self.blocks[bid] = RefBlock(stream=s)
            next_id += per_stream
        self.next_id = next_id
        self.gap_lo = next_id  # the gap: [gap_lo, next_id) less gap_taken
        self.gap_taken: set[int] = set()
        self.owner_blocks: dict[Owner, list[int]] = {}
        self.active: set[Owner] = set()
        self.counters = RefCounters(n_blocks=len(self.blocks))

    def fragmented(self) -> int:
        size = self.config.block_size
        return sum(1 for b in self.blocks.values() if b.owner is not None and b.n_used < size)

    def record(self) -> None:
        c = self.counters
        c.history.append(
            (
                c.n_blocks,
                c.n_allocations,
                c.n_frees,
                c.n_reused,
                c.n_exhausted,
                c.n_grown,
                c.n_retired,
                c.peak_blocks_in_use,
                self.fragmented(),
            )
        )

    def stream_of(self, stream: str) -> str:
        if not self.config.separate_kv:
            return "kv"
        if stream not in ("k", "v"):
            raise ValueError(stream)
        return stream

    def n_free(self, s: str) -> int:
        return sum(1 for bid in self.free[s] if self.blocks[bid].owner is None)

    def _drop_placeholder(self, bid: int) -> None:
        # Off the free list while held: freeing it appends it, so it reads as used before.
        self.blocks[bid].ever_allocated = True

    def claim(
        self, owner: Owner, stream: str, ids: list[int], fills: list[int] | None, fmt: str
    ) -> list[int]:
        """Raises ValueError for bad arguments, LookupError for an id that is not free."""
        s = self.stream_of(stream)
        size = self.config.block_size
        if not ids or len(set(ids)) != len(ids):
            raise ValueError(ids)
        if fills is not None and (len(fills) != len(ids) or not all(0 <= n <= size for n in fills)):
            raise ValueError(fills)
        grown: list[int] = []
        for bid in ids:
            if bid in self.free[s] and self.blocks[bid].owner is None:
                continue
            if bid < self.gap_lo or bid in self.gap_taken:
                raise LookupError(bid)
            max_blocks = self.config.max_blocks
            if not self.config.grow_on_exhaustion or (
                max_blocks is not None
                and (bid >= max_blocks or len(self.blocks) + len(grown) + 1 > max_blocks)
            ):
                raise LookupError(bid)
            grown.append(bid)
        for bid in grown:  # held, on no free list: freeing it lists it as used before
            self.blocks[bid] = RefBlock(stream=s, ever_allocated=True)
            self.gap_taken.add(bid)
            self.next_id = max(self.next_id, bid + 1)
        self.counters.n_grown += len(grown)
        self.counters.n_blocks = len(self.blocks)
        self.active.add(owner)
        for i, bid in enumerate(ids):
            block = self.blocks[bid]
            block.owner = owner
            block.format = fmt
            block.n_used = size if fills is None else fills[i]
            self.counters.n_allocations += 1
        return self._hand_out(owner, ids)

    def _hand_out(self, owner: Owner, ids: list[int]) -> list[int]:
        """What allocate and claim share once their blocks are set: the owner's list, the peak,
        the history row."""
        self.owner_blocks.setdefault(owner, []).extend(ids)
        c = self.counters
        c.peak_blocks_in_use = max(c.peak_blocks_in_use, c.n_allocations - c.n_frees)
        self.record()
        return ids

    def register(self, owner: Owner) -> None:
        if owner in self.active:
            raise KeyError(owner)
        self.active.add(owner)

    def allocate(self, stream: str, n_tokens: int, owner: Owner, fmt: str) -> list[int]:
        """Returns block ids; raises ValueError, KeyError (owner active) or MemoryError."""
        if n_tokens <= 0:
            raise ValueError(n_tokens)
        s = self.stream_of(stream)
        size = self.config.block_size
        n_needed = -(-n_tokens // size)
        if owner not in self.active:
            self.register(owner)
        free = self.free[s]
        if self.n_free(s) < n_needed and self.config.grow_on_exhaustion:
            n_short = n_needed - self.n_free(s)
            if self.config.max_blocks is not None:
                n_short = min(n_short, self.config.max_blocks - len(self.blocks))
            for _ in range(max(0, n_short)):
                bid = self._next_growth_id()
                self.blocks[bid] = RefBlock(stream=s)
                free.append(bid)
                self.counters.n_grown += 1
            self.counters.n_blocks = len(self.blocks)
        if self.n_free(s) < n_needed:
            self.counters.n_exhausted += 1
            self.record()
            raise MemoryError(n_needed)
        ids = []
        remaining = n_tokens
        while len(ids) < n_needed:
            bid = free.pop()
            block = self.blocks[bid]
            if block.owner is not None:
                self._drop_placeholder(bid)
                continue
            if block.ever_allocated:
                self.counters.n_reused += 1
            block.owner = owner
            block.format = fmt
            block.n_used = min(remaining, size)
            block.ever_allocated = True
            remaining -= block.n_used
            ids.append(bid)
            self.counters.n_allocations += 1
        return self._hand_out(owner, ids)

    def _next_growth_id(self) -> int:
        """The id a growth lists next: the gap's lowest untaken id, else a new one."""
        while self.gap_lo < self.next_id:
            bid = self.gap_lo
            self.gap_lo += 1
            if bid in self.gap_taken:
                self.gap_taken.discard(bid)
                continue
            return bid
        bid = self.next_id
        self.next_id += 1
        self.gap_lo = self.next_id
        return bid

    def _free_one(self, bid: int) -> None:
        block = self.blocks.get(bid)
        if block is None or block.owner is None:
            return
        owned = self.owner_blocks[block.owner]
        owned.remove(bid)
        if not owned:
            del self.owner_blocks[block.owner]
            self.active.discard(block.owner)
        block.owner = None
        block.n_used = 0
        if bid not in self.free[block.stream]:  # a claimed id still listed is free in place
            self.free[block.stream].append(bid)
        self.counters.n_frees += 1

    def free_ids(self, ids: list[int]) -> None:
        for bid in ids:
            self._free_one(bid)
        self.record()

    def free_all(self, owner: Owner) -> None:
        for bid in list(self.owner_blocks.get(owner, [])):
            self._free_one(bid)
        self.active.discard(owner)
        self.record()

    def shrink(self, stream: str, target_free: int) -> int:
        if target_free < 0:
            raise ValueError(target_free)
        s = self.stream_of(stream)
        free = self.free[s]
        for bid in [b for b in free if self.blocks[b].owner is not None]:
            self._drop_placeholder(bid)
        free[:] = [b for b in free if self.blocks[b].owner is None]
        n = max(0, len(free) - target_free)
        for _ in range(n):
            del self.blocks[free.pop()]
        self.counters.n_blocks = len(self.blocks)
        self.counters.n_retired += n
        if n:  # the seed records a row only when something was retired
            self.record()
        return n

    def mark_used(self, bid: int, n_used: int) -> None:
        if not 0 <= n_used <= self.config.block_size:
            raise ValueError(n_used)
        block = self.blocks.get(bid)
        if block is not None and block.owner is not None:
            block.n_used = n_used
