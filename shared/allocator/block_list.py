"""BlockList: the blocks one allocation handed out, and the allocator's record of it."""

from __future__ import annotations

from typing import SupportsIndex

from vqpool.shared.pool import Block, Owner


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
