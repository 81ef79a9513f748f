"""The block pool allocator (see ``block_pool_allocator``)."""

from vqpool.shared.allocator.block_pool_allocator import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_HISTORY_SIZE,
    AllocationStats,
    Block,
    BlockList,
    BlockPoolAllocator,
    Owner,
    PoolConfig,
)

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
