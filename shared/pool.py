"""The block pool's interface, :class:`BlockPool`, and the values it speaks in.

Code written against :class:`BlockPool` (the pooled KV cache, the serving worker, the test suite)
runs unchanged on a :class:`~vqpool.shared.allocator.BlockPoolAllocator` in the same process or on
a ``vqpool.worker.PoolClient`` talking to ``vqpoold``.

The values (``PoolConfig``, ``Owner``, ``Block``, and ``AllocationStats`` from
:mod:`vqpool.shared.stats`) are the seed allocator's. They live here, below both implementations,
so that the interface does not import the allocator that implements it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

from vqpool.shared.stats import AllocationStats

# Token slots per block. Amortizes per-allocation overhead (as in vLLM/PagedAttention) while
# keeping the waste per sequence (at most block_size - 1 slots) small next to generation lengths.
DEFAULT_BLOCK_SIZE: int = 16

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


class AllocationRequest(NamedTuple):
    """One item of :meth:`BlockPool.allocate_many`: the arguments of one ``allocate`` call."""

    stream: str
    n_tokens: int
    owner: Owner
    format: str = "fp16"


AllocationResult = Sequence[Block] | Exception
"""Per item of ``allocate_many``: the blocks, or the exception ``allocate`` would have raised."""


@runtime_checkable
class BlockPool(Protocol):
    """Block bookkeeping as the seed allocator defines it, plus batched calls."""

    @property
    def config(self) -> PoolConfig: ...

    @property
    def stats(self) -> AllocationStats: ...

    def allocate(
        self, stream: str, n_tokens: int, owner: Owner, format: str = "fp16"
    ) -> Sequence[Block]: ...

    def allocate_many(self, requests: Sequence[AllocationRequest]) -> list[AllocationResult]: ...

    def free(self, blocks: Iterable[Block]) -> None: ...

    def free_all(self, owner: Owner) -> None: ...

    def register_owner(self, owner: Owner) -> None: ...

    def release_owner(self, owner: Owner) -> None: ...

    def blocks_for(self, owner: Owner) -> list[Block]: ...

    def n_free(self, stream: str = "k") -> int: ...

    def mark_used(self, block: Block, n_used: int) -> None: ...

    def mark_used_many(self, updates: Iterable[tuple[Block, int]]) -> None: ...
