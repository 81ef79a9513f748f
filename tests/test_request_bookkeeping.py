"""The daemon's per-request bookkeeping in process: the reply cache's bounds, and allocations that
are all or nothing in the Coordinator whatever is raised (tests/test_daemon_requests.py drives
the same rules through a real vqpoold)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest
from daemon_harness import remove_tree, short_tmpdir
from vqpool.daemon.core.coordinator import Coordinator
from vqpool.daemon.core.replies import ReplyCache
from vqpool.daemon.core.sessions import Session
from vqpool.shared import PoolConfig
from vqpool.shared.errors import BadRequestError

# -- the reply cache -------------------------------------------------------------------------------


def test_reply_cache_bounds_each_session_in_count_and_bytes() -> None:
    cache = ReplyCache(per_session=4, bytes_per_session=100, bytes_total=10_000)
    for rid in range(1, 11):
        cache.remember(1, rid, b"x" * 10)
    assert len(cache) == 4 and cache.n_bytes == 40
    assert cache.lookup(1, 10) == b"x" * 10
    assert cache.lookup(1, 11) is None  # new
    with pytest.raises(BadRequestError, match="older than this session's reply cache"):
        cache.lookup(1, 6)
    cache.remember(1, 11, b"y" * 60)
    cache.remember(1, 12, b"z" * 500)  # over the budget alone: kept, as the latest
    assert cache.lookup(1, 12) == b"z" * 500
    assert cache.n_bytes == 10 + 10 + 60 + 500  # the count bound: 9, 10, 11, 12
    with pytest.raises(BadRequestError):
        cache.lookup(1, 8)
    cache.remember(1, 13, b"w")  # 12 is not the latest any more: over the byte budget, gone
    assert cache.n_bytes == 1
    with pytest.raises(BadRequestError):
        cache.lookup(1, 12)
    cache.forget(1)
    assert (len(cache), cache.n_bytes) == (0, 0)
    assert cache.lookup(1, 1) is None  # a forgotten session refuses nothing (it is gone)


def test_reply_cache_total_spares_every_sessions_latest_reply() -> None:
    cache = ReplyCache(per_session=64, bytes_per_session=1000, bytes_total=250)
    for sid in (1, 2, 3):
        for rid in (1, 2):
            cache.remember(sid, rid, bytes(100))
    # Oldest first across sessions, never a session's latest: only latest replies are left.
    assert cache.n_bytes == 300 and len(cache) == 3
    for sid in (1, 2, 3):
        assert cache.lookup(sid, 2) == bytes(100)
        with pytest.raises(BadRequestError):
            cache.lookup(sid, 1)
    cache.remember(2, 3, bytes(10))  # session 2's 2 is no longer its latest: it goes first
    assert cache.n_bytes == 210
    assert cache.lookup(1, 2) == cache.lookup(3, 2) == bytes(100)
    with pytest.raises(BadRequestError):
        cache.lookup(2, 2)


def test_a_stale_id_is_not_remembered() -> None:
    cache = ReplyCache(per_session=1, bytes_per_session=100, bytes_total=100)
    cache.remember(1, 5, b"a")
    cache.remember(1, 6, b"b")
    cache.remember(1, 5, b"again")  # refused upstream; must not come back
    with pytest.raises(BadRequestError):
        cache.lookup(1, 5)
    assert cache.n_bytes == 1


# -- the coordinator: all or nothing ---------------------------------------------------------------


@pytest.fixture
def coord() -> Iterator[Coordinator]:
    base = short_tmpdir()
    run_dir = base / "run"
    run_dir.mkdir()
    yield Coordinator(PoolConfig(n_blocks=64), lease=1.0, run_dir=run_dir)
    remove_tree(base)


def open_session(coord: Coordinator, model: str) -> Session:
    return coord.sessions.open(psutil.Process(os.getpid()), model, {}, "", model, 0.0)


def state(coord: Coordinator) -> tuple[Any, ...]:
    """Counters, then who holds which owner and what each holds."""
    allocator = coord.allocator
    holders = {str(o): getattr(coord.holder_of(o), "sid", None) for o in allocator.owners()}
    return (
        allocator.stats.snapshot(),
        holders,
        {str(o): allocator.usage(o) for o in allocator.owners()},
        {s.sid: sorted(map(str, s.owners)) for s in coord.sessions},
    )


def fail_on_call(n: int, exc: type[BaseException], real: Callable[..., Any]) -> Callable[..., Any]:
    """``real``, except that its ``n``-th call raises ``exc``."""
    calls = 0

    def call(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == n:
            raise exc("injected")
        return real(*args)

    return call


@pytest.mark.parametrize("exc", [MemoryError, KeyboardInterrupt])
def test_allocate_many_interrupted_part_way_is_undone(
    coord: Coordinator, exc: type[BaseException]
) -> None:
    mine = open_session(coord, "mine")
    coord.allocate(mine, "k", 40, "held", "fp16")
    coord.register_owner(mine, "registered")
    before = state(coord)
    allocate_ids_each = coord.allocator.allocate_ids_each

    def interrupted_at_item_4(items: Any, results: Any, unbound: Any) -> None:
        def first_three() -> Any:  # then the interruption, before the fourth item
            yield from items[:3]
            raise exc("injected")

        allocate_ids_each(first_three(), results, unbound)

    coord.allocator.allocate_ids_each = interrupted_at_item_4  # type: ignore[method-assign]
    items = [
        ("k", 16, "new", "fp16"),
        ("v", 32, "held", "fp16"),
        ("v", 16, "registered", "fp16"),
        ("k", 16, "new-too", "fp16"),
    ]
    with pytest.raises(exc):
        coord.allocate_many(mine, items)
    del coord.allocator.allocate_ids_each  # type: ignore[method-assign]
    assert coord.audit() == []
    after = state(coord)
    assert after[1:] == before[1:]  # owners, holders, holdings: as before
    assert after[0].blocks_in_use() == before[0].blocks_in_use()
    assert all(isinstance(result, list) for result in coord.allocate_many(mine, items))
    assert coord.audit() == []


@pytest.mark.parametrize("exc", [MemoryError, KeyboardInterrupt])
def test_allocate_interrupted_while_binding_is_undone(
    coord: Coordinator, exc: type[BaseException]
) -> None:
    mine = open_session(coord, "mine")
    before = state(coord)

    class FailingOwners(set[Any]):
        def add(self, owner: Any) -> None:
            raise exc("injected")

    mine.owners = FailingOwners()
    with pytest.raises(exc):
        coord.allocate(mine, "k", 40, "new", "fp16")
    mine.owners = set()
    assert coord.audit() == []
    assert state(coord) == before
    assert coord.holder_of("new") is None


def test_exhausted_allocate_binds_nothing(coord: Coordinator) -> None:
    a, b = open_session(coord, "a"), open_session(coord, "b")
    coord.allocate(a, "k", 30 * 16, "big", "fp16")
    with pytest.raises(Exception, match="requested 3 block"):
        coord.allocate(a, "k", 3 * 16, "new", "fp16")
    assert coord.holder_of("new") is None and not coord.allocator.is_active("new")
    coord.register_owner(b, "new")
    assert coord.audit() == []
