"""FreeList: one stream's free block ids, in the order the seed's free list hands them out."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence

NO_MARK = sys.maxsize
"""A FreeList's ``low`` when its mark is not known: the next one-block allocate() folds."""


class FreeList:
    """One stream's free blocks: a stack of recycled ids on top of a never-used id range.

    Reading the seed's free list bottom to top gives ``range(fresh_lo, fresh_hi)`` followed by
    ``recycled``; both hand out from the top, so the same ids come out in the same order. The
    allocator's hot paths (allocate, free) read and cut these fields in place; the rarer changes
    (growth, claims, retirement) are the methods below.

    ``claimed`` holds ids that ``BlockPoolAllocator.claim`` took out of the middle of that list
    without moving anything (removing an id from the middle of a range or a stack is not O(1)):
    they are still listed but held, and are skipped when allocation or shrinking reaches them.
    Freed before that, such an id is simply free again at its old place. Empty except after a
    daemon restart's claims, so the hot paths pay one truth test for it.
    """

    __slots__ = (
        "claimed",
        "fresh_hi",
        "fresh_lo",
        "low",
        "never_used",
        "recycled",
        "recycled_index",
        "total",
    )

    def __init__(self, lo: int, hi: int) -> None:
        self.fresh_lo = lo
        self.fresh_hi = hi
        self.recycled: list[int] = []
        self.claimed: set[int] = set()
        self.total = hi - lo
        # The allocator's mark (see AllocatorState._fold_locked): a one-block allocate() that
        # leaves fewer recycled ids than this may raise the peak in use, so it folds the logged
        # counts at once. NO_MARK until the allocator sets it.
        self.low = NO_MARK
        # Ids on the recycled stack that were never handed out (added by growth, or moved off
        # the fresh range by unlist_claimed): their first allocation is not a reuse.
        self.never_used: set[int] = set()
        # ``recycled`` as a set for claim(), with the key it was built at (see recycled_set);
        # None until a claim needs it.
        self.recycled_index: tuple[tuple[int, ...], set[int]] | None = None

    def n_free(self) -> int:
        return len(self.recycled) + self.fresh_hi - self.fresh_lo - len(self.claimed)

    def give_back(self, ids: Iterable[int]) -> None:
        """Put freed ids back: claimed ids are still listed, so they are free again in place."""
        claimed = self.claimed
        if not claimed:
            self.recycled.extend(ids)
            return
        append = self.recycled.append
        for block_id in ids:
            if block_id in claimed:
                claimed.discard(block_id)
            else:
                append(block_id)

    def grow(self, new_ids: Sequence[int]) -> None:
        """List ids new to the pool on top of the stack, never used; all or nothing."""
        recycled = self.recycled
        n_listed = len(recycled)
        try:
            recycled.extend(new_ids)
            self.never_used.update(new_ids)
        except BaseException:  # a growth cut short leaves no id behind
            if len(recycled) != n_listed:
                del recycled[n_listed:]
            self.never_used.difference_update(new_ids)
            raise
        self.total += len(new_ids)

    def retire(self, n: int) -> list[int]:
        """Take ``n`` free ids off the top for good. Claimed ids must be unlisted first
        (:meth:`unlist_claimed`). Returns the ids retired from the recycled stack; those of the
        fresh range were never handed out, so nothing else names them."""
        recycled = self.recycled
        from_recycled = min(n, len(recycled))
        retired_ids: list[int] = []
        if from_recycled:
            retired_ids = recycled[-from_recycled:]
            del recycled[-from_recycled:]
            self.never_used.difference_update(retired_ids)
        self.fresh_hi -= n - from_recycled
        self.total -= n
        return retired_ids

    # -- claimed ids ---------------------------------------------------------------------------

    def plan_past_claimed(self, n: int) -> tuple[tuple[int, ...], int, int, int, list[int]]:
        """The ``n`` ids allocate() takes from the top, past the claimed ids met on the way
        (they are held: once out of the list, a free appends them as usual); changes nothing.
        Returns the ids, how many come from the recycled stack, how many ids of the stack stay,
        the new top of the fresh range, and the claimed ids passed."""
        claimed = self.claimed
        recycled = self.recycled
        taken: list[int] = []
        passed: list[int] = []
        n_reused = 0
        keep = len(recycled)
        hi = self.fresh_hi
        while len(taken) < n:
            if keep:
                keep -= 1
                block_id = recycled[keep]
                if block_id in claimed:
                    passed.append(block_id)
                    continue
                n_reused += 1
            else:
                hi -= 1
                block_id = hi
                if block_id in claimed:
                    passed.append(block_id)
                    continue
            taken.append(block_id)
        return tuple(taken), n_reused, keep, hi, passed

    def recycled_set(self, key: tuple[int, ...]) -> set[int]:
        """The ids on the recycled stack as a set, rebuilt only when ``key`` differs from the
        one it was built at (the caller's key says when the stack may have gained ids)."""
        index = self.recycled_index
        if index is None or index[0] != key:
            index = self.recycled_index = (key, set(self.recycled))
        return index[1]

    def unlist_claimed(self) -> None:
        """Rewrite the list so that it holds only free ids, keeping their order. O(stream).

        Needed before retiring ids: retirement takes whole slices off the top. Never-used ids
        moved from the fresh range onto the stack are remembered as never used, so their first
        allocation does not count as a reuse.
        """
        claimed = self.claimed
        in_fresh = [i for i in claimed if self.fresh_lo <= i < self.fresh_hi]
        moved: list[int] = []
        if in_fresh:
            lowest = min(in_fresh)
            moved = [i for i in range(lowest, self.fresh_hi) if i not in claimed]
            self.fresh_hi = lowest
            self.never_used.update(moved)
        self.never_used.difference_update(claimed)
        self.recycled[:] = [*moved, *(i for i in self.recycled if i not in claimed)]
        claimed.clear()
