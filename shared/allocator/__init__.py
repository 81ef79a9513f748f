"""Fixed-size KV-cache block bookkeeping: which block ids are free, and which owner holds which.

This is the allocator the daemon serves to every worker, and the one a single process can use
directly. It holds no array data: a block id is an index that a backing store (see
``vqpool.worker.MLXBlockStorage``) maps to memory.

Behaviour follows the seed specification (``BlockPoolAllocator`` of VeloxQuant-MLX) call for
call: the same block ids in the same order, the same counters, the same errors; this package
exports the names the seed's module did. The representation is different, because the seed's
costs grew with the pool, with the order of frees, and with every block it handed out:

* No object per free block. Each stream's free list is a stack of recycled ids on top of a
  never-used id range kept as two ints, so building a pool of a million blocks is O(1)
  (``free_list``).
* One record per allocation: a ``BlockList`` (the ids, stream, format and owner they share);
  the only per-block bookkeeping is one dict write (block id -> its BlockList), done in C, and
  only once something looks a block up by id: an allocation freed whole never pays it.
  ``allocate()`` returns that BlockList filled with its ``Block`` objects, a real ``list`` as
  the seed returns; what the caller does to the list never changes the allocator's record
  (``block_ids``). As in the seed, an id has one Block object for the pool's life; unlike the
  seed's, it is made on the id's first ``allocate()``, and its owner, format and fill are read
  from the allocation that last handed it out (``PoolBlock``), so no allocate or free writes a
  field per block.
  ``allocate_ids()`` (the daemon's path) neither makes nor changes a Block (``block_list``).
* Frees in any order are O(1) per block: a block is found through that dict, never searched for.
  ``free_all`` hands whole allocations back and leaves their dict entries behind, stale: an
  entry counts only while its allocation is not dead, and a new allocation overwrites it.
* History keeps a tuple of counters per mutating call; ``AllocationStats`` objects are built
  only when someone reads ``history`` (``state``). The commonest calls (a one-block allocate of
  a recycled id, the free of such an allocation, mark_used) do not even update the counters:
  each logs a code, and the log is folded into the counters and their history rows, in order,
  before anything reads or changes them otherwise (``state.ALLOC_ONE``).

The class is built in layers, one job each: ``state.AllocatorState`` (the bookkeeping, its
reads, the owner registry, the audit), ``claims.RestartClaims`` (claim by id after a daemon
restart) and ``block_pool_allocator.BlockPoolAllocator`` (allocate, free, shrink, fill).
"""

from vqpool.shared.allocator.block_list import BlockList
from vqpool.shared.allocator.block_pool_allocator import BlockPoolAllocator
from vqpool.shared.allocator.state import DEFAULT_HISTORY_SIZE
from vqpool.shared.pool import DEFAULT_BLOCK_SIZE, Block, Owner, PoolConfig
from vqpool.shared.stats import AllocationStats

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
