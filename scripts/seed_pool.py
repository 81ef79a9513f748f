"""The seed allocator (../shared/seed/block_pool_allocator.txt) made runnable, for benchmarks only.

The benchmarks compare the allocator with the seed in the same run, on the same machine state,
never with figures from another day. This is the seed's code as written, re-indented (the text
lost its indentation), without its docstrings, ``[docs]`` residue and Prometheus rendering (not
measured), and with vqpool's exception classes in place of VeloxQuant-MLX's. Its defects (the
quadratic ``free``, a history snapshot per call, one object per block) are kept: they are what the
seed costs.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from vqpool.shared.errors import BlockPoolExhaustedError, OwnerAlreadyActiveError

DEFAULT_BLOCK_SIZE: int = 16
DEFAULT_HISTORY_SIZE: int = 256


@dataclass
class PoolConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
    n_blocks: int = 1024
    separate_kv: bool = True
    grow_on_exhaustion: bool = False
    max_blocks: int | None = None


@dataclass
class Block:
    block_id: int
    stream: str = "kv"
    format: str = "fp16"
    n_used: int = 0
    owner: int | None = None
    ever_allocated: bool = False


@dataclass
class AllocationStats:
    n_blocks: int
    n_allocations: int = 0
    n_frees: int = 0
    n_reused: int = 0
    n_exhausted: int = 0
    n_grown: int = 0
    n_retired: int = 0
    peak_blocks_in_use: int = 0

    def blocks_in_use(self) -> int:
        return self.n_allocations - self.n_frees

    _fragmented_count: int = field(default=0, repr=False)

    def snapshot(self) -> AllocationStats:
        copy = AllocationStats(
            n_blocks=self.n_blocks,
            n_allocations=self.n_allocations,
            n_frees=self.n_frees,
            n_reused=self.n_reused,
            n_exhausted=self.n_exhausted,
            n_grown=self.n_grown,
            n_retired=self.n_retired,
            peak_blocks_in_use=self.peak_blocks_in_use,
        )
        copy._fragmented_count = self._fragmented_count
        return copy


class BlockPoolAllocator:
    def __init__(self, config: PoolConfig | None = None) -> None:
        self.config = config or PoolConfig()
        self._streams = ("k", "v") if self.config.separate_kv else ("kv",)
        self._lock = threading.Lock()
        self._free: dict[str, list[int]] = {s: [] for s in self._streams}
        self._blocks: dict[int, Block] = {}
        self._owner_blocks: dict[int, list[int]] = {}
        self._active_owners: set[int] = set()
        self._next_block_id = 0
        for stream in self._streams:
            n_per_stream = (
                self.config.n_blocks
                if len(self._streams) == 1
                else (self.config.n_blocks // len(self._streams))
            )
            self._add_blocks(stream, n_per_stream)
        self.stats = AllocationStats(n_blocks=len(self._blocks))
        self.history: deque[AllocationStats] = deque(maxlen=DEFAULT_HISTORY_SIZE)

    def _add_blocks(self, stream: str, count: int) -> None:
        for _ in range(count):
            block_id = self._next_block_id
            self._next_block_id += 1
            self._blocks[block_id] = Block(block_id=block_id, stream=stream)
            self._free[stream].append(block_id)

    def _resolve_stream(self, stream: str) -> str:
        if not self.config.separate_kv:
            return "kv"
        if stream not in ("k", "v"):
            raise ValueError(f"BlockPoolAllocator: stream must be 'k' or 'v', got {stream!r}")
        return stream

    def _record_history(self) -> None:
        self.history.append(self.stats.snapshot())

    def register_owner(self, owner: int) -> None:
        with self._lock:
            self._register_owner_locked(owner)

    def _register_owner_locked(self, owner: int) -> None:
        if owner in self._active_owners:
            raise OwnerAlreadyActiveError(
                f"BlockPoolAllocator: owner {owner!r} is already active "
                "(has checked-out blocks or was registered without a "
                "matching free_all/release_owner). Use a different owner "
                "id, or free_all(owner) first if this is intentional reuse."
            )
        self._active_owners.add(owner)

    def release_owner(self, owner: int) -> None:
        with self._lock:
            self._active_owners.discard(owner)

    def allocate(self, stream: str, n_tokens: int, owner: int, format: str = "fp16") -> list[Block]:
        if n_tokens <= 0:
            raise ValueError(f"BlockPoolAllocator: n_tokens must be > 0, got {n_tokens}")
        s = self._resolve_stream(stream)
        n_needed = -(-n_tokens // self.config.block_size)  # ceil div
        with self._lock:
            if owner not in self._active_owners:
                self._register_owner_locked(owner)
            free_list = self._free[s]
            if len(free_list) < n_needed:
                self._try_grow_locked(s, n_needed - len(free_list))
            if len(free_list) < n_needed:
                self.stats.n_exhausted += 1
                self._record_history()
                raise BlockPoolExhaustedError(
                    f"BlockPoolAllocator: requested {n_needed} block(s) for stream "
                    f"{s!r} but only {len(free_list)} free (pool size "
                    f"{len(self._blocks)})."
                )
            allocated: list[Block] = []
            remaining = n_tokens
            for _ in range(n_needed):
                block_id = free_list.pop()  # LIFO: reuse the most recently freed block first
                block = self._blocks[block_id]
                is_reuse = block.ever_allocated
                block.owner = owner
                block.format = format
                block.n_used = min(remaining, self.config.block_size)
                block.ever_allocated = True
                remaining -= block.n_used
                allocated.append(block)
                self.stats.n_allocations += 1
                if is_reuse:
                    self.stats.n_reused += 1
                if block.n_used < self.config.block_size:
                    self.stats._fragmented_count += 1
            self._owner_blocks.setdefault(owner, []).extend(b.block_id for b in allocated)
            self.stats.peak_blocks_in_use = max(
                self.stats.peak_blocks_in_use, self.stats.blocks_in_use()
            )
            self._record_history()
            return allocated

    def _try_grow_locked(self, stream: str, n_short: int) -> None:
        if not self.config.grow_on_exhaustion:
            return
        if self.config.max_blocks is not None:
            headroom = self.config.max_blocks - len(self._blocks)
            if headroom <= 0:
                return
            n_short = min(n_short, headroom)
        if n_short <= 0:
            return
        self._add_blocks(stream, n_short)
        self.stats.n_blocks = len(self._blocks)
        self.stats.n_grown += n_short

    def free(self, blocks: list[Block]) -> None:
        with self._lock:
            self._free_locked(blocks)
            self._record_history()

    def _free_locked(self, blocks: list[Block]) -> None:
        for block in blocks:
            if block.owner is None:
                continue  # already free; idempotent
            owner = block.owner
            owner_list = self._owner_blocks.get(owner)
            if owner_list is not None and block.block_id in owner_list:
                owner_list.remove(block.block_id)
                if not owner_list:
                    del self._owner_blocks[owner]
                    self._active_owners.discard(owner)
            if block.n_used < self.config.block_size:
                self.stats._fragmented_count -= 1
            block.owner = None
            block.n_used = 0
            self._free[block.stream].append(block.block_id)
            self.stats.n_frees += 1

    def free_all(self, owner: int) -> None:
        with self._lock:
            block_ids = self._owner_blocks.pop(owner, [])
            blocks = [self._blocks[bid] for bid in block_ids]
            for block in blocks:
                if block.owner is None:
                    continue  # already free; idempotent
                if block.n_used < self.config.block_size:
                    self.stats._fragmented_count -= 1
                block.owner = None
                block.n_used = 0
                self._free[block.stream].append(block.block_id)
                self.stats.n_frees += 1
            self._active_owners.discard(owner)
            self._record_history()

    def blocks_for(self, owner: int) -> list[Block]:
        with self._lock:
            return [self._blocks[bid] for bid in self._owner_blocks.get(owner, [])]

    def n_free(self, stream: str = "k") -> int:
        s = self._resolve_stream(stream)
        with self._lock:
            return len(self._free[s])

    def mark_used(self, block: Block, n_used: int) -> None:
        full = self.config.block_size
        with self._lock:
            was_fragmented = block.owner is not None and block.n_used < full
            block.n_used = n_used
            is_fragmented = block.owner is not None and block.n_used < full
            if is_fragmented and not was_fragmented:
                self.stats._fragmented_count += 1
            elif was_fragmented and not is_fragmented:
                self.stats._fragmented_count -= 1
