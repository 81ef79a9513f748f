"""The ``cancel`` worker op: a session gives up one of its own allocations waiting at the daemon.
A waiting one is answered CANCELLED and leaves its model's queue; one answered already is left
as it is; an unknown or another session's request id is refused and nothing changes. And
PoolClient's side: a waiting call given up from another thread is cancelled at the daemon."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from daemon_harness import wait_until
from test_daemon_budget import ModelClient, budget_daemon, clients, error_code
from vqpool.shared import AllocationRequest
from vqpool.shared.errors import ErrorCode, RequestCancelledError
from vqpool.worker import PoolClient
from vqpool.worker.testing.launch import DaemonProcess

__all__ = ["clients"]  # the fixture, shared with test_daemon_budget


def one_waiting(
    start_daemon: Callable[..., DaemonProcess], clients: Callable[..., ModelClient]
) -> tuple[DaemonProcess, ModelClient, ModelClient, int]:
    """A daemon whose budget model a fills, and model b's allocate waiting there: (daemon, a,
    b, the waiting request's id, one a's session never used)."""
    daemon = budget_daemon(start_daemon, "--budget", "2000")
    a = clients(daemon, "a", 1000)
    b = clients(daemon, "b", 1000)
    assert a.allocate("a", 2)["ok"]
    b.next_id = 100
    rid = b.send_allocate("b", 1, wait=30)
    assert b.no_reply(0.1)
    assert daemon.admin("budget")["waiting"] == 1
    return daemon, a, b, rid


def replies(client: ModelClient, n: int) -> dict[int, dict[str, Any]]:
    """The next ``n`` replies on ``client``'s socket, by request id."""
    got = [client.recv() for _ in range(n)]
    return {reply["id"]: reply for reply in got}


def cancel(client: ModelClient, rid: int) -> int:
    """Send a cancel of request ``rid`` without reading the reply; the cancel's request id."""
    cancel_rid = client.next_id
    client.next_id += 1
    client.send(client.encode("cancel", {"request": rid}, cancel_rid))
    return cancel_rid


def test_a_cancelled_waiting_allocate_is_answered_and_leaves_the_queue(
    start_daemon: Callable[..., DaemonProcess], clients: Callable[..., ModelClient]
) -> None:
    daemon, a, b, rid = one_waiting(start_daemon, clients)
    held = daemon.admin("budget")["total_held"]
    cancel_rid = cancel(b, rid)
    got = replies(b, 2)
    assert got[cancel_rid]["ok"] and got[cancel_rid]["result"] == {"cancelled": True}
    assert error_code(got[rid]) == ErrorCode.CANCELLED
    assert "cancelled by its session" in got[rid]["error"]["message"]
    assert daemon.admin("budget")["waiting"] == 0
    assert daemon.admin("budget")["total_held"] == held
    b.send_allocate("b", 1, wait=30, rid=rid)  # a resend gets the cancelled answer
    assert b.recv() == got[rid]
    # Cancelling it again: answered already, nothing changes.
    again = b.call("cancel", {"request": rid})
    assert again["ok"] and again["result"] == {"cancelled": False}
    assert a.call("free_all", {"owner": "a"})["ok"]
    assert b.no_reply(0.2)  # nothing granted to the cancelled request
    assert daemon.admin("budget")["total_held"] == 0
    daemon.audit()


def test_a_cancel_reaches_only_its_own_sessions_waiting_requests(
    start_daemon: Callable[..., DaemonProcess], clients: Callable[..., ModelClient]
) -> None:
    daemon, a, b, rid = one_waiting(start_daemon, clients)
    before = daemon.admin("budget")
    foreign = a.call("cancel", {"request": rid})  # b's request id, from a's session
    assert error_code(foreign) == ErrorCode.BAD_REQUEST
    assert "not an allocation waiting" in foreign["error"]["message"]
    unknown = b.call("cancel", {"request": 10_000})
    assert error_code(unknown) == ErrorCode.BAD_REQUEST
    for bad in (-1, "x", None):
        assert error_code(b.call("cancel", {"request": bad})) == ErrorCode.BAD_REQUEST
    assert daemon.admin("budget") == before  # b's request still waits
    assert a.call("free_all", {"owner": "a"})["ok"]
    granted = b.recv()
    assert granted["ok"] and granted["id"] == rid
    late = b.call("cancel", {"request": rid})  # granted already: left as it is
    assert late["ok"] and late["result"] == {"cancelled": False}
    assert daemon.admin("budget")["total_held"] == 1000
    daemon.audit()


@pytest.mark.parametrize("started", [True, False], ids=["parked", "not-sent"])
def test_a_waiting_call_given_up_from_another_thread_is_cancelled_at_the_daemon(
    start_daemon: Callable[..., DaemonProcess], started: bool
) -> None:
    daemon = budget_daemon(start_daemon, "--budget", "16384")
    with (
        PoolClient(daemon.run_dir, name="hog", bytes_per_block=4096) as hog,
        PoolClient(daemon.run_dir, name="m", bytes_per_block=4096) as pool,
    ):
        hog.allocate("k", 4 * hog.config.block_size, "hog")
        give_up = threading.Event()
        if not started:
            give_up.set()
        outcome: list[BaseException] = []

        def waiting_call() -> None:
            with pool.cancellable(give_up):
                try:
                    pool.allocate_many([AllocationRequest("k", 16, "m-1")], wait=30.0)
                except BaseException as exc:
                    outcome.append(exc)

        thread = threading.Thread(target=waiting_call)
        started_at = time.monotonic()
        thread.start()
        if started:
            wait_until(lambda: daemon.admin("budget")["waiting"] == 1, timeout=5.0)
            give_up.set()
        thread.join(10)
        assert not thread.is_alive()
        assert time.monotonic() - started_at < 10  # not the 30 s wait
        assert len(outcome) == 1 and isinstance(outcome[0], RequestCancelledError), outcome
        assert daemon.admin("budget")["waiting"] == 0
        assert daemon.admin("budget")["total_held"] == 4 * 4096
        pool.ping()  # the client goes on
        hog.free_all("hog")
        daemon.audit()
