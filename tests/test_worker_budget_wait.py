"""PoolClient against a live vqpoold with a byte budget: allocations that wait at the daemon
(without holding the client's lock) and the fit answer."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from daemon_harness import remove_tree, short_tmpdir, wait_until
from fault_proxy import FaultyProxy
from vqpool.shared import AllocationRequest, Block
from vqpool.shared.errors import BlockPoolExhaustedError, DaemonUnavailableError, NoSessionError
from vqpool.worker import PoolClient
from vqpool.worker.testing.launch import DaemonProcess

BLOCK_BYTES = 4096
BUDGET_BLOCKS = 16  # per stream pair: 8 blocks of k and 8 of v
BLOCK_SIZE = 16


@pytest.fixture
def budget_daemon(start_daemon: Callable[..., DaemonProcess]) -> DaemonProcess:
    return start_daemon(
        "--budget", f"{BUDGET_BLOCKS * BLOCK_BYTES}B", "--block-size", str(BLOCK_SIZE)
    )


@pytest.fixture
def pool(budget_daemon: DaemonProcess) -> Iterator[PoolClient]:
    client = PoolClient(budget_daemon.run_dir, name="m", bytes_per_block=BLOCK_BYTES, timeout=5.0)
    yield client
    client.close()


def pair(owner: str, n_blocks: int) -> list[AllocationRequest]:
    return [
        AllocationRequest("k", n_blocks * BLOCK_SIZE, owner),
        AllocationRequest("v", n_blocks * BLOCK_SIZE, owner),
    ]


def blocks_of(results: list[Any]) -> list[Block]:
    assert not any(isinstance(r, Exception) for r in results), results
    return [b for r in results for b in r]


def test_a_waiting_allocation_leaves_the_client_free_for_other_calls(pool: PoolClient) -> None:
    full = blocks_of(pool.allocate_many(pair("x", BUDGET_BLOCKS // 2)))
    outcome: list[Any] = []

    def wait_for_room() -> None:
        outcome.append(pool.allocate_many(pair("y", 1), wait=30.0))

    waiter = threading.Thread(target=wait_for_room)
    waiter.start()
    time.sleep(0.3)  # long enough for the request to be parked at the daemon
    assert waiter.is_alive(), outcome
    # The same client serves other calls while its allocation is parked.
    pool.mark_used(full[0], 3)
    pool.ping()
    pool.free([full[0], full[BUDGET_BLOCKS // 2]])  # one k and one v block: room for the pair
    waiter.join(10)
    assert not waiter.is_alive()
    granted = blocks_of(outcome[0])
    assert {b.owner for b in granted} == {"y"}
    assert {b.block_id for b in pool.blocks_for("y")} == {b.block_id for b in granted}
    assert sorted(b.block_id for b in pool.held_blocks()) == sorted(
        b.block_id
        for b in [*full[1 : BUDGET_BLOCKS // 2], *full[BUDGET_BLOCKS // 2 + 1 :], *granted]
    )


def test_a_wait_that_runs_out_raises_exhausted_and_holds_nothing(pool: PoolClient) -> None:
    blocks_of(pool.allocate_many(pair("x", BUDGET_BLOCKS // 2)))
    with pytest.raises(BlockPoolExhaustedError, match="budget"):
        pool.allocate("k", BLOCK_SIZE, "late", wait=0.3)
    # The items' bytes are one request to the budget: the whole call is refused.
    with pytest.raises(BlockPoolExhaustedError, match="waited"):
        pool.allocate_many(pair("late", 1), wait=0.3)
    assert all(b.owner == "x" for b in pool.held_blocks())


def test_wait_outside_its_range_is_refused_before_any_call(pool: PoolClient) -> None:
    for wait in (-1.0, 60.5):
        with pytest.raises(ValueError, match="wait"):
            pool.allocate("k", BLOCK_SIZE, "o", wait=wait)
        with pytest.raises(ValueError, match="wait"):
            pool.allocate_many(pair("o", 1), wait=wait)
    assert list(pool.held_blocks()) == []


def test_closing_the_client_ends_a_parked_call(budget_daemon: DaemonProcess) -> None:
    holder = PoolClient(budget_daemon.run_dir, name="m", bytes_per_block=BLOCK_BYTES)
    client = PoolClient(budget_daemon.run_dir, name="m", bytes_per_block=BLOCK_BYTES)
    try:
        blocks_of(holder.allocate_many(pair("x", BUDGET_BLOCKS // 2)))
        errors: list[BaseException] = []

        def park() -> None:
            try:
                client.allocate_many(pair("y", 1), wait=30.0)
            except BaseException as exc:
                errors.append(exc)

        waiter = threading.Thread(target=park)
        waiter.start()
        time.sleep(0.3)
        client.close()
        waiter.join(5)
        assert not waiter.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], NoSessionError), errors
        # The session ended with the parked request: the holder's blocks are all that is held.
        held = budget_daemon.admin("stats")
        assert held["budget"]["total_held"] == BUDGET_BLOCKS * BLOCK_BYTES
    finally:
        holder.close()
        client.close()


def test_a_parked_call_follows_a_daemon_restart(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    options = ("--budget", f"{BUDGET_BLOCKS * BLOCK_BYTES}B", "--lease", "1")
    daemon = start_daemon(*options)
    client = PoolClient(daemon.run_dir, name="m", bytes_per_block=BLOCK_BYTES, timeout=10.0)
    try:
        full = blocks_of(client.allocate_many(pair("x", BUDGET_BLOCKS // 2)))
        outcome: list[Any] = []
        waiter = threading.Thread(
            target=lambda: outcome.append(client.allocate_many(pair("y", 1), wait=30.0))
        )
        waiter.start()
        time.sleep(0.3)
        daemon.stop(signal.SIGKILL)
        daemon = start_daemon(*options, run_dir=daemon.run_dir)
        # The heartbeat re-syncs (x is claimed back, the budget is full again); the parked
        # call is sent again to the new daemon, where it waits until x gives some back.
        deadline = time.monotonic() + 10
        while not client.resyncs:
            assert time.monotonic() < deadline, "the client never re-synced"
            time.sleep(0.05)
        assert waiter.is_alive(), outcome
        client.free([full[0], full[BUDGET_BLOCKS // 2]])
        waiter.join(10)
        assert not waiter.is_alive()
        granted = blocks_of(outcome[0])
        assert {b.block_id for b in client.blocks_for("y")} == {b.block_id for b in granted}
        assert daemon.admin("audit")["ok"]
    finally:
        client.close()


def test_fit_answers_for_the_clients_model(pool: PoolClient) -> None:
    small = pool.fit(BLOCK_SIZE)
    assert small["verdict"] == "now"
    assert small["need"] == 2 * BLOCK_BYTES  # one block of k and one of v
    assert small["max_concurrency_now"] == BUDGET_BLOCKS // 2
    huge = pool.fit(BLOCK_SIZE * BUDGET_BLOCKS)
    assert huge["verdict"] == "never"
    assert huge["budget"] == BUDGET_BLOCKS * BLOCK_BYTES
    with pytest.raises(ValueError):
        pool.fit(0)


@pytest.fixture
def late_grants(budget_daemon: DaemonProcess) -> Iterator[tuple[PoolClient, FaultyProxy]]:
    """A client whose allocations reach the daemon 1.5 s late (through FaultyProxy), with a
    deadline of 0.2 + 0.5 s: it gives up on each before the daemon grants it."""
    proxy_base = short_tmpdir()
    proxy_dir = proxy_base / "run"
    proxy_dir.mkdir(mode=0o700)
    proxy = FaultyProxy(
        proxy_dir, budget_daemon.run_dir, drop=0, duplicate=0, delay=0
    ).start_and_wait()
    client = PoolClient(proxy_dir, name="m", bytes_per_block=BLOCK_BYTES, timeout=0.5)
    try:
        yield client, proxy
    finally:
        client.close()
        proxy.stop()
        remove_tree(proxy_base)


def give_up_on_a_grant(client: PoolClient, proxy: FaultyProxy, daemon: DaemonProcess) -> None:
    """An allocate_many the client abandons (DaemonUnavailableError), granted after that."""
    proxy.delay_ops = {"allocate_many": 1.5}
    with pytest.raises(DaemonUnavailableError):
        client.allocate_many(pair("late", 2), wait=0.2)
    assert list(client.held_blocks()) == []
    # The daemon grants it when it arrives: blocks held for an owner the worker never saw.
    wait_until(lambda: daemon.admin("stats")["budget"]["total_held"] > 0, timeout=5.0)
    proxy.delay_ops = {}


def test_blocks_granted_to_an_abandoned_allocation_go_back_at_the_next_call(
    budget_daemon: DaemonProcess, late_grants: tuple[PoolClient, FaultyProxy]
) -> None:
    client, proxy = late_grants
    give_up_on_a_grant(client, proxy, budget_daemon)
    client.ping()  # the daemon answers again: the client asks what became of the allocation
    assert budget_daemon.admin("stats")["budget"]["total_held"] == 0
    # The owner is free: the worker may use it again, and the whole budget is there.
    blocks = blocks_of(client.allocate_many(pair("late", BUDGET_BLOCKS // 2)))
    assert len(blocks) == BUDGET_BLOCKS
    client.free_all("late")
    assert budget_daemon.admin("stats")["budget"]["total_held"] == 0
    budget_daemon.audit()


def test_an_idle_worker_gives_back_an_abandoned_grant_from_its_heartbeat(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    daemon = start_daemon("--budget", f"{BUDGET_BLOCKS * BLOCK_BYTES}B", "--lease", "1")
    proxy_base = short_tmpdir()
    proxy_dir = proxy_base / "run"
    proxy_dir.mkdir(mode=0o700)
    proxy = FaultyProxy(proxy_dir, daemon.run_dir, drop=0, duplicate=0, delay=0).start_and_wait()
    client = PoolClient(proxy_dir, name="m", bytes_per_block=BLOCK_BYTES, timeout=0.5)
    try:
        give_up_on_a_grant(client, proxy, daemon)
        # No call from the worker: its heartbeat (every 0.25 s here) settles it.
        wait_until(lambda: daemon.admin("stats")["budget"]["total_held"] == 0, timeout=5.0)
        daemon.audit()
    finally:
        client.close()
        proxy.stop()
        remove_tree(proxy_base)
