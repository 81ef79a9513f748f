"""BlockList: the blocks one allocation handed out, and the allocator's record of it."""

from __future__ import annotations

from typing import SupportsIndex

from vqpool.shared.pool import Block, Owner


class BlockList(list[Block]):
    """The blocks one ``allocate()`` (or ``claim()``) call handed out, in order: a real
    ``list``, as the seed's ``allocate`` returns, and also the allocator's own record of that
    allocation (its "chunk"), so an allocation costs one object beside its Blocks.

    The list is filled with its ``Block`` objects before it is handed out, so every reader sees
    them, C code that reads a list's storage directly (msgpack, ``list.__len__``) included. They
    are the pool's own objects, one per block id, as the seed keeps them: an allocation changes
    their fields in place, so a Block still held from a freed allocation shows the block's next
    owner once the id is handed out again (as in the seed).

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
        # The pool's Block objects of these ids (one per id, kept for the pool's life, see
        # AllocatorState), in allocation order: the list itself may since have been reordered
        # or changed by its caller. None on the ids path.
        self._blocks: list[Block] | None = None

    def __reduce_ex__(
        self, protocol: SupportsIndex
    ) -> tuple[type[list[Block]], tuple[list[Block]]]:
        # A copy or an unpickled list is not the allocation's record: a plain list of the blocks.
        return (list, (list(self),))
