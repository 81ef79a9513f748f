"""BlockList and PoolBlock: the blocks one allocation handed out, the allocator's record of it,
and the pool's one Block object per id, which reads its fields from that record."""

from __future__ import annotations

from typing import Protocol, SupportsIndex

from vqpool.shared.pool import Block, Owner


class BlockList(list[Block]):
    """The blocks one ``allocate()`` (or ``claim()``) call handed out, in order: a real
    ``list``, as the seed's ``allocate`` returns, and also the allocator's own record of that
    allocation (its "chunk"), so an allocation costs one object beside its Blocks.

    The list is filled with its ``Block`` objects before it is handed out, so every reader sees
    them, C code that reads a list's storage directly (msgpack, ``list.__len__``) included. They
    are the pool's own objects, one per block id, as the seed keeps them (:class:`PoolBlock`):
    a Block still held from a freed allocation shows the block's next owner once the id is
    handed out again (as in the seed).

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

    # No __init__: calling a Python __init__ from the type call costs more than the stores,
    # and the commonest allocate() builds its record inline. Built by new_record().
    block_ids: tuple[int, ...]
    stream: str
    format: str
    owner: Owner
    fill: dict[int, int] | None  # block id -> n_used, for blocks not full
    n_freed: int  # blocks of this allocation freed one by one
    dead: bool  # every block freed: map entries still naming this chunk are stale
    # The pool's Block objects of these ids, in allocation order: the list itself may since
    # have been reordered or changed by its caller. None on the ids path.
    _blocks: tuple[PoolBlock, ...] | None

    def __reduce_ex__(
        self, protocol: SupportsIndex
    ) -> tuple[type[list[Block]], tuple[list[Block]]]:
        # A copy or an unpickled list is not the allocation's record: a plain list of the blocks.
        return (list, (list(self),))


def new_record(ids: tuple[int, ...], stream: str, format: str, owner: Owner) -> BlockList:
    """A new allocation's record, its list empty, nothing freed or filled yet."""
    chunk = BlockList()
    chunk.block_ids, chunk.stream, chunk.format, chunk.owner = ids, stream, format, owner
    chunk.fill, chunk.n_freed, chunk.dead, chunk._blocks = None, 0, False, None
    return chunk


class _Pool(Protocol):
    """What a PoolBlock reads of its pool (the allocator's state)."""

    _block_size: int
    _chunk_of: dict[int, BlockList]


class PoolBlock(Block):
    """The pool's own ``Block`` of one id: made on the id's first public allocation or claim
    and kept for the pool's life, as the seed keeps one object per id.

    ``owner``, ``format`` and ``n_used`` are not stored but read, when asked, from ``_chunk``,
    the allocation (BlockList) that last handed the block out: allocating or freeing a block
    sets no field of it (an allocation points its blocks at itself, one store each; a free
    stores nothing). While that allocation holds the block, they are its owner, format and
    fill; once it no longer does (freed, or the id is held through the ids path), the block
    is free: owner None, n_used 0, and the format of its last public allocation, as the seed's
    object keeps it. ``block_id``, ``stream`` and ``ever_allocated`` are plain fields.

    Its fields are the allocator's to change: ``mark_used`` and ``free`` do. Writing
    ``n_used`` of a free block sets it until the block is handed out again (the seed's object
    kept any value written); every other write raises AttributeError.

    It equals a ``Block`` of the same values, and its copies (``copy``, ``deepcopy``,
    pickling) are plain ``Block`` records of its values when copied.
    """

    __slots__ = ("_chunk", "_free_used", "_pool", "alone", "alone_fill", "alone_id")

    def __init__(self, block_id: int, stream: str, pool: _Pool, chunk: BlockList) -> None:
        # Block's generated __init__ would write the read-only fields: set the stored ones.
        self.block_id = block_id
        self.stream = stream
        self.ever_allocated = True  # it exists only to be handed out
        self._pool = pool
        self._chunk = chunk
        # (allocation, n_used) written on this block while free after that allocation
        self._free_used: tuple[BlockList, int] | None = None
        # This block and its id as 1-tuples, made once: the record of a one-block allocation
        # (the commonest) shares them instead of building two tuples each time.
        self.alone = (self,)
        self.alone_id = (block_id,)
        # The fill map of its one-block allocations that fill it partly, made on the first:
        # one such allocation holds it at a time (the block is held by one), and nothing reads
        # the fill of a dead allocation, so the next one takes it over.
        self.alone_fill: dict[int, int] | None = None

    def _holder(self) -> BlockList | None:
        """The allocation holding this block now, if the one that last handed it out still
        does; None once it is free. An allocation that freed blocks one by one has all its ids
        in the pool's id map (a free by id maps every allocation first), and a block it freed
        is no longer mapped to it."""
        chunk = self._chunk
        if chunk.dead or (chunk.n_freed and self._pool._chunk_of.get(self.block_id) is not chunk):
            return None
        return chunk

    @property
    def owner(self) -> Owner | None:
        chunk = self._holder()
        return None if chunk is None else chunk.owner

    @owner.setter
    def owner(self, value: Owner | None) -> None:
        raise AttributeError("a pool's Block changes owner by allocate() and free(), not a write")

    @property
    def format(self) -> str:
        return self._chunk.format

    @format.setter
    def format(self, value: str) -> None:
        raise AttributeError("a pool's Block takes its format from allocate(), not from a write")

    @property
    def n_used(self) -> int:
        chunk = self._holder()
        if chunk is None:
            written = self._free_used
            return written[1] if written is not None and written[0] is self._chunk else 0
        fill = chunk.fill
        size = self._pool._block_size
        return fill.get(self.block_id, size) if fill else size

    @n_used.setter
    def n_used(self, value: int) -> None:
        if self._holder() is not None:
            raise AttributeError(
                "the fill of a held block is set by BlockPoolAllocator.mark_used(), which keeps "
                "the fragmentation count exact"
            )
        self._free_used = (self._chunk, value)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Block):
            return NotImplemented
        return (
            self.block_id,
            self.stream,
            self.format,
            self.n_used,
            self.owner,
            self.ever_allocated,
        ) == (
            other.block_id,
            other.stream,
            other.format,
            other.n_used,
            other.owner,
            other.ever_allocated,
        )

    __hash__ = None  # type: ignore[assignment]  # as Block: mutable, compared by value

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[type[Block], tuple[object, ...]]:
        return (
            Block,
            (self.block_id, self.stream, self.format, self.n_used, self.owner, True),
        )
