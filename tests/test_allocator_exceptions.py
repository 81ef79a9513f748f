"""allocate() is all or nothing whatever is raised inside it (MemoryError, KeyboardInterrupt).

Each test arms one of the allocator's containers to raise from its next change, calls
allocate(), disarms it, and checks that nothing changed: same counters, history, free blocks,
owners and holdings, the invariants hold, and the next allocations hand out the same ids as a
twin pool that never failed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import pytest
import vqpool.shared.allocator.block_pool_allocator as allocator_module
import vqpool.shared.allocator.claims as claims_module
import vqpool.shared.allocator.state as state_module
from vqpool.shared import BlockPoolAllocator, PoolConfig

# The modules that build an allocation's record (allocate(), claim()) and Block objects (the
# pool's own, PoolBlock).
BUILT_IN = {
    "new_record": (allocator_module, claims_module),
    "PoolBlock": (state_module,),
}


def armed(kind: type, methods: tuple[str, ...], exc: type[BaseException]) -> type:
    """A subclass of ``kind`` whose ``methods`` raise ``exc`` while its ``armed`` is True."""

    def make(name: str) -> Callable[..., Any]:
        base = getattr(kind, name)

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            if self.armed:
                raise exc("injected")
            return base(self, *args, **kwargs)

        return method

    return type(f"Armed{kind.__name__}", (kind,), {"armed": True, **{m: make(m) for m in methods}})


def arm_chunk_map(pool: BlockPoolAllocator, exc: type[BaseException]) -> Any:
    pool._chunk_of = armed(dict, ("__setitem__", "update"), exc)(pool._chunk_of)
    return pool._chunk_of


def arm_holdings(pool: BlockPoolAllocator, exc: type[BaseException]) -> Any:
    pool._holdings = armed(dict, ("__setitem__", "setdefault"), exc)(pool._holdings)
    for owner, chunks in list(pool._holdings.items()):  # an owner growing adds to its own map
        if isinstance(chunks, dict):  # (an owner of one allocation is filed with it alone)
            dict.__setitem__(pool._holdings, owner, armed(dict, ("__setitem__",), exc)(chunks))
    return pool._holdings


def arm_active_owners(pool: BlockPoolAllocator, exc: type[BaseException]) -> Any:
    pool._active_owners = armed(set, ("add",), exc)(pool._active_owners)
    return pool._active_owners


class ArmedRecords:
    """The history and the log of counts folded into it (a one-block allocate() logs its
    counts, and folds them when it may raise the peak), armed together."""

    def __init__(self, pool: BlockPoolAllocator, exc: type[BaseException]) -> None:
        history = pool._history
        pool._history = self.history = armed(deque, ("append", "extend"), exc)(
            history, history.maxlen
        )
        pool._events = self.events = armed(list, ("append",), exc)(pool._events)

    @property
    def armed(self) -> bool:
        return bool(self.history.armed)

    @armed.setter
    def armed(self, value: bool) -> None:
        self.history.armed = self.events.armed = value


def arm_history(pool: BlockPoolAllocator, exc: type[BaseException]) -> Any:
    return ArmedRecords(pool, exc)


def arm_free_list(pool: BlockPoolAllocator, exc: type[BaseException]) -> Any:
    free = pool._free["k"]
    free.recycled = armed(list, ("pop", "__delitem__", "extend"), exc)(free.recycled)
    return free.recycled


def disarm(pool: BlockPoolAllocator, container: Any) -> None:
    container.armed = False
    for chunks in pool._holdings.values():
        if hasattr(chunks, "armed"):
            chunks.armed = False


ARMS = {
    "chunk map": arm_chunk_map,
    "holdings": arm_holdings,
    "active owners": arm_active_owners,
    "history": arm_history,
    "free list": arm_free_list,
}


def observable(pool: BlockPoolAllocator) -> tuple[Any, ...]:
    return (
        pool.stats.snapshot(),
        [row.snapshot() for row in pool.history],
        {s: (pool.n_free(s), pool.n_total(s)) for s in pool.streams},
        sorted(map(str, pool.active_owners())),
        {str(o): [(b.block_id, b.n_used) for b in pool.blocks_for(o)] for o in pool.owners()},
    )


def busy_pool(claimed: bool) -> BlockPoolAllocator:
    """A pool with held, freed (recycled) and never-used blocks, and optionally claimed ids."""
    pool = BlockPoolAllocator(PoolConfig(n_blocks=64))
    pool.allocate("k", 40, "held")
    other = pool.allocate("k", 20, "other")
    pool.register_owner("registered")
    pool.free(other[:1])
    if claimed:
        pool.claim("claimer", "k", [25, 20])
    return pool


@pytest.mark.parametrize("arm", ARMS.values(), ids=ARMS.keys())
@pytest.mark.parametrize("exc", [MemoryError, KeyboardInterrupt])
@pytest.mark.parametrize("n_tokens", [16, 100], ids=["one-block", "recycled-and-fresh"])
@pytest.mark.parametrize("owner", ["new", "held", "registered"])
@pytest.mark.parametrize("claimed", [False, True], ids=["plain", "after-claims"])
@pytest.mark.parametrize("ids_path", [False, True], ids=["blocks", "ids"])
def test_allocate_changes_nothing_when_interrupted(
    arm: Callable[[BlockPoolAllocator, type[BaseException]], Any],
    exc: type[BaseException],
    n_tokens: int,
    owner: str,
    claimed: bool,
    ids_path: bool,
) -> None:
    pool, twin = busy_pool(claimed), busy_pool(claimed)
    before = observable(pool)
    container = arm(pool, exc)
    with pytest.raises(exc):
        (pool.allocate_ids if ids_path else pool.allocate)("k", n_tokens, owner)
    disarm(pool, container)
    pool.check_invariants()
    assert observable(pool) == before
    assert pool.is_active(owner) == twin.is_active(owner)
    for n in (n_tokens, 16, 200):
        assert pool.allocate("k", n, owner).block_ids == twin.allocate("k", n, owner).block_ids
    assert observable(pool) == observable(twin)
    pool.check_invariants()


@pytest.mark.parametrize("built", ["new_record", "PoolBlock"], ids=["record", "blocks"])
@pytest.mark.parametrize("claimed", [False, True], ids=["plain", "after-claims"])
def test_allocate_interrupted_building_its_list_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, built: str, claimed: bool
) -> None:
    # The allocation's record (a BlockList) and its Block objects are built before anything
    # changes; building either can fail.
    pool, twin = busy_pool(claimed), busy_pool(claimed)
    before = observable(pool)

    def interrupted(*args: Any) -> None:
        raise KeyboardInterrupt

    for module in BUILT_IN[built]:
        monkeypatch.setattr(module, built, interrupted)
    with pytest.raises(KeyboardInterrupt):
        pool.allocate("k", 100, "new")
    with pytest.raises(KeyboardInterrupt):
        pool.claim("claimer-2", "k", [10])
    monkeypatch.undo()
    pool.check_invariants()
    assert observable(pool) == before
    assert pool.allocate("k", 100, "new").block_ids == twin.allocate("k", 100, "new").block_ids
    assert observable(pool) == observable(twin)


def test_ids_path_builds_no_block(monkeypatch: pytest.MonkeyPatch) -> None:
    pool, twin = busy_pool(True), busy_pool(True)

    def interrupted(*args: Any) -> None:
        raise KeyboardInterrupt

    for module in BUILT_IN["PoolBlock"]:
        monkeypatch.setattr(module, "PoolBlock", interrupted)
    ids = pool.allocate_ids("k", 100, "new")
    claimed = pool.claim_ids("claimer-2", "k", [10, 11], [3, 16])
    pool.free_ids(ids[:2])
    pool.free_ids(claimed)
    monkeypatch.undo()
    want = twin.allocate("k", 100, "new")
    twin.claim("claimer-2", "k", [10, 11], [3, 16])
    twin.free(want[:2])
    twin.free_all("claimer-2")
    assert ids == want.block_ids and claimed == (10, 11)
    assert observable(pool) == observable(twin)
    pool.check_invariants()


@pytest.mark.parametrize("exc", [MemoryError, KeyboardInterrupt])
def test_growth_interrupted_changes_nothing(exc: type[BaseException]) -> None:
    config = PoolConfig(n_blocks=8, grow_on_exhaustion=True)
    pool, twin = BlockPoolAllocator(config), BlockPoolAllocator(config)
    for p in (pool, twin):
        p.allocate("k", 16 * 3, "held")
    before = observable(pool)
    container = arm_free_list(pool, exc)
    with pytest.raises(exc):
        pool.allocate("k", 16 * 10, "new")
    disarm(pool, container)
    pool.check_invariants()
    assert observable(pool) == before
    assert not pool.is_active("new")
    grown = pool.allocate("k", 16 * 10, "new")
    assert grown.block_ids == twin.allocate("k", 16 * 10, "new").block_ids
    assert observable(pool) == observable(twin)


def test_failure_after_growth_keeps_the_grown_blocks_free() -> None:
    pool = BlockPoolAllocator(PoolConfig(n_blocks=8, grow_on_exhaustion=True))
    pool.allocate("k", 16 * 3, "held")
    container = arm_chunk_map(pool, MemoryError)
    with pytest.raises(MemoryError):
        pool.allocate("k", 16 * 10, "new")
    disarm(pool, container)
    pool.check_invariants()
    assert not pool.is_active("new")
    assert pool.stats.blocks_in_use() == 3
    assert (pool.n_free("k"), pool.n_total("k")) == (10, 13)  # grown by the shortfall, all free
    assert len(pool.allocate("k", 16 * 10, "new")) == 10
    assert pool.stats.n_reused == 0  # the grown ids were never used: their first use is no reuse
    pool.check_invariants()
