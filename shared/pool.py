"""The interface shared by the local allocator and the daemon's client.

Code written against :class:`BlockPool` (the pooled KV cache, the serving worker, the test suite)
runs unchanged on a :class:`~vqpool.shared.allocator.BlockPoolAllocator` in the same process or on
a ``vqpool.worker.PoolClient`` talking to ``vqpoold``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

from vqpool.shared.allocator import AllocationStats, Block, Owner, PoolConfig


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
