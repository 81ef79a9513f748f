"""Owners a client lost: the daemon no longer counts their blocks as this worker's.

An owner is lost when a restarted daemon refuses its claim (a block already claimed by another
worker, or outside the new pool), or when the daemon ended this live session (an admin
eviction, an expired lease) and freed its blocks. Its blocks are forgotten by the client (they
may be handed to someone else now), and every call naming the owner or one of its blocks raises
:class:`ClaimConflictError` with the reason, until ``free_all`` or ``release_owner`` forgets it.
Guarded by the client's lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from vqpool.shared.allocator import Owner
from vqpool.shared.errors import ClaimConflictError


class LostOwners:
    """The owners lost, with why, and the ids of the blocks they held."""

    def __init__(self) -> None:
        self._why: dict[Owner, str] = {}
        self._blocks: dict[int, Owner] = {}

    def add(self, owner: Owner, why: str, block_ids: Iterable[int]) -> None:
        """``owner`` is lost (its blocks ``block_ids``); calls naming it raise
        ClaimConflictError(``why``)."""
        self._why[owner] = why
        for block_id in block_ids:
            self._blocks[block_id] = owner

    def reasons(self) -> dict[Owner, str]:
        """Each lost owner with why (a copy)."""
        return dict(self._why)

    def refuse(self, owner: Owner) -> None:
        """Raises ClaimConflictError if ``owner`` is lost."""
        why = self._why.get(owner)
        if why is not None:
            raise ClaimConflictError(why)

    def refuse_blocks(self, block_ids: Iterable[int]) -> None:
        """Raises ClaimConflictError if a block of ``block_ids`` is a lost owner's."""
        lost = self._blocks
        if lost:
            for block_id in block_ids:
                owner = lost.get(block_id)
                if owner is not None:
                    raise ClaimConflictError(self._why[owner])

    def reason_in(self, args: Mapping[str, Any]) -> str | None:
        """Why a call with ``args`` names a lost owner or a block of one; None if it does not."""
        owners = [args.get("owner")] + [item[2] for item in args.get("items", ())]
        for owner in owners:
            if owner is not None and owner in self._why:
                return self._why[owner]
        block_ids = list(args.get("block_ids", ())) + [u[0] for u in args.get("updates", ())]
        for block_id in block_ids:
            if block_id in self._blocks:
                return self._why[self._blocks[block_id]]
        return None

    def forget(self, owner: Owner) -> bool:
        """Forget a lost owner (free_all/release_owner of it); whether it was lost."""
        if self._why.pop(owner, None) is None:
            return False
        for block_id in [b for b, o in self._blocks.items() if o == owner]:
            del self._blocks[block_id]
        return True
