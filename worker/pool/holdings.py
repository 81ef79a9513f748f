"""What a client's session holds: the :class:`Block` objects it handed out and its owners.

The client keeps the Block objects it handed out, as the local allocator does, so ``free`` /
``free_all`` / ``mark_used`` update the caller's objects the same way; and each owner with its
block ids in allocation order, which is what a re-sync after a daemon restart re-declares.
Guarded by the client's lock.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from vqpool.shared.allocator import Block, Owner, PoolConfig


class Holdings:
    """The blocks and owners one session holds (see the module docstring)."""

    def __init__(self) -> None:
        self.blocks: dict[int, Block] = {}
        self.owners: dict[Owner, dict[int, None]] = {}
        """Owners held (registered, or holding blocks) -> their block ids in allocation
        order."""

    def add(
        self,
        block_ids: list[int],
        stream: str,
        n_tokens: int,
        owner: Owner,
        fmt: str,
        config: PoolConfig,
    ) -> list[Block]:
        """The Block objects of an allocate reply (fill is implied: full but the last), now
        held by ``owner``."""
        block_size = config.block_size
        resolved = stream if config.separate_kv else "kv"
        blocks = [Block(bid, resolved, fmt, block_size, owner, True) for bid in block_ids]
        if blocks:
            blocks[-1].n_used = n_tokens - (len(blocks) - 1) * block_size
        held = self.blocks
        owned = self.owners.setdefault(owner, {})
        for block in blocks:
            held[block.block_id] = block
            owned[block.block_id] = None
        return blocks

    def forget(self, block_id: int) -> Block | None:
        """Forget a freed block (and its owner with its last block, as the daemon releases
        it); the Block object, emptied, or None if it was not held."""
        block = self.blocks.pop(block_id, None)
        if block is not None:
            owned = self.owners.get(block.owner)  # type: ignore[arg-type]
            if owned is not None:
                owned.pop(block_id, None)
                if not owned:  # its last block: the daemon released the owner too
                    del self.owners[block.owner]  # type: ignore[arg-type]
            block.owner = None
            block.n_used = 0
        return block

    def forget_owner(self, owner: Owner) -> list[int]:
        """Forget ``owner`` and its blocks (their Block objects lose their owner); their ids."""
        block_ids = list(self.owners.pop(owner, {}))
        for block_id in block_ids:
            block = self.blocks.pop(block_id, None)
            if block is not None:
                block.owner = None
        return block_ids

    def forget_if_empty(self, owner: Owner) -> None:
        """Forget ``owner`` if it is held with no block (the daemon released it)."""
        if self.owners.get(owner) == {}:
            del self.owners[owner]

    def held_bytes(
        self,
        cost: int | Mapping[str, int] | None,
        per_format: Mapping[str, int | Mapping[str, int]] | None = None,
    ) -> int:
        """Bytes the blocks held take at ``cost`` bytes per block (for all streams, or per
        stream; 0 when None), a block of a format ``per_format`` names at that format's (as
        the daemon charges them)."""
        n_bytes = 0
        for block in list(self.blocks.values()):
            price = cost if per_format is None else per_format.get(block.format, cost)
            if price is None:
                continue
            n_bytes += price if isinstance(price, int) else price.get(block.stream, 0)
        return n_bytes

    def held_blocks(self) -> Iterator[Block]:
        return iter(list(self.blocks.values()))

    def clear(self) -> None:
        self.blocks.clear()
        self.owners.clear()
