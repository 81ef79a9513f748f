"""Cross-process ownership through a real vqpoold and real worker processes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import AgentError, AgentProcess, RawClient
from vqpool.shared.errors import ErrorCode
from vqpool.worker.testing.launch import DaemonProcess

StartWorker = Callable[[Path, str], AgentProcess]


def pool_state(daemon: DaemonProcess) -> dict[str, Any]:
    """Everything observable about the pool from the admin socket (uptime left out)."""
    stats = daemon.admin("stats")
    return {
        "stats": stats["stats"],
        "streams": stats["streams"],
        "owners": sorted(
            (str(o["owner"]), o["sid"], o["n_blocks"], o["tokens"]) for o in daemon.admin("owners")
        ),
    }


@pytest.fixture
def two_workers(
    daemon: DaemonProcess, start_worker: StartWorker
) -> tuple[AgentProcess, AgentProcess]:
    return start_worker(daemon.run_dir, "model-a"), start_worker(daemon.run_dir, "model-b")


def test_owner_ids_collide_across_processes(
    daemon: DaemonProcess, two_workers: tuple[AgentProcess, AgentProcess]
) -> None:
    a, b = two_workers
    a.call("register_owner", "req-1")
    a.call("allocate", "k", 20, 7)
    before = pool_state(daemon)
    for op, args in (
        ("register_owner", ("req-1",)),
        ("allocate", ("k", 16, "req-1")),
        ("register_owner", (7,)),
        ("allocate", ("v", 16, 7)),
    ):
        with pytest.raises(AgentError) as caught:
            b.call(op, *args)
        assert caught.value.kind == "OwnerAlreadyActiveError"
        assert "another worker session" in str(caught.value)
    assert pool_state(daemon) == before
    results = b.call("allocate_many", [["k", 16, 7, "fp16"], ["k", 16, 8, "fp16"]])
    assert results[0] == "OwnerAlreadyActiveError"
    assert len(results[1]) == 1  # the other item of the batch is served
    daemon.audit()
    # Once a releases the id, b may take it.
    a.call("free_all", 7)
    assert len(b.call("allocate", "v", 16, 7)) == 1
    daemon.audit()


def test_not_owner_requests_are_refused_whole(
    daemon: DaemonProcess, two_workers: tuple[AgentProcess, AgentProcess]
) -> None:
    a, b = two_workers
    a_blocks = a.call("allocate", "k", 40, "a-req")
    b_blocks = b.call("allocate", "k", 40, "b-req")
    before = pool_state(daemon)
    refusals: list[tuple[str, tuple[Any, ...]]] = [
        ("free", (a_blocks,)),
        ("free", ([*b_blocks, a_blocks[0]],)),  # one foreign id spoils the whole request
        ("mark_used", ([[b_blocks[0], 3], [a_blocks[-1], 16]],)),
        ("free_all", ("a-req",)),
        ("blocks_for", ("a-req",)),
        ("release_owner", ("a-req",)),
    ]
    for op, args in refusals:
        with pytest.raises(AgentError) as caught:
            b.call(op, *args)
        assert caught.value.kind == "NotOwnerError", (op, caught.value)
        assert pool_state(daemon) == before, op
    assert [row[0] for row in a.call("blocks_for", "a-req")] == a_blocks
    assert [row[0] for row in b.call("blocks_for", "b-req")] == b_blocks
    daemon.audit()


def test_free_skips_free_ids_like_the_local_allocator(
    daemon: DaemonProcess, two_workers: tuple[AgentProcess, AgentProcess]
) -> None:
    a, _ = two_workers
    blocks = a.call("allocate", "k", 32, "r")
    a.call("free", blocks)
    a.call("free", blocks)  # already free: skipped, as BlockPoolAllocator.free does
    assert daemon.admin("stats")["stats"]["blocks_in_use"] == 0
    daemon.audit()


def test_goodbye_frees_everything_including_empty_owners(
    daemon: DaemonProcess, start_worker: StartWorker
) -> None:
    a = start_worker(daemon.run_dir, "a")
    a.call("register_owner", "empty")
    a.call("allocate", "k", 64, "full")
    a.call("close")
    stats = daemon.admin("stats")
    assert stats["stats"]["blocks_in_use"] == 0
    assert stats["sessions"] == 0 and stats["owners"] == 0
    b = start_worker(daemon.run_dir, "b")
    b.call("register_owner", "empty")  # the id is free again
    daemon.audit()


def test_admin_views_describe_sessions_and_owners(
    daemon: DaemonProcess, two_workers: tuple[AgentProcess, AgentProcess]
) -> None:
    a, b = two_workers
    a.call("allocate", "k", 40, "a1")
    a.call("allocate", "v", 40, "a1")
    a.call("register_owner", "a2")
    b.call("allocate", "k", 16, "b1")
    sessions = {s["pid"]: s for s in daemon.admin("sessions")}
    view = sessions[a.pid]
    assert view["model"] == "model-a"
    assert view["blocks"] == {"k": 3, "v": 3}
    assert view["bytes"] == {"k": 3 * 4096, "v": 3 * 4096}
    assert view["bytes_total"] == 6 * 4096
    assert view["n_owners"] == 2
    assert view["lease"]["state"] == "ok"
    assert view["process"] in ("running", "sleeping")
    assert sessions[b.pid]["n_blocks"] == 1
    owners = {o["owner"]: o for o in daemon.admin("owners", sid=a.session_id)}
    assert owners["a1"]["blocks"] == {"k": 3, "v": 3}
    assert owners["a1"]["tokens"] == 40 and owners["a1"]["fill"] == pytest.approx(40 / 48)
    assert owners["a2"]["n_blocks"] == 0
    assert {o["owner"] for o in daemon.admin("owners")} == {"a1", "a2", "b1"}


def test_evict_session_frees_its_blocks(
    daemon: DaemonProcess, two_workers: tuple[AgentProcess, AgentProcess]
) -> None:
    a, b = two_workers
    a.call("allocate", "k", 64, "a1")
    b_blocks = b.call("allocate", "k", 32, "b1")
    result = daemon.admin("evict_session", sid=a.session_id)
    assert result == {"sid": a.session_id, "pid": a.pid, "owners_freed": 1, "blocks_freed": 4}
    # The evicted worker lives on: its owners are lost (their blocks were freed), and it opens
    # a new session for new owners by itself.
    with pytest.raises(AgentError) as caught:
        a.call("allocate", "k", 16, "a1")
    assert caught.value.kind == "ClaimConflictError" and "evicted" in str(caught.value)
    assert len(a.call("allocate", "k", 16, "a2")) == 1
    assert {s["pid"] for s in daemon.admin("sessions")} == {a.pid, b.pid}
    a.call("free_all", "a1")  # forgets the lost owner
    assert len(a.call("allocate", "k", 16, "a1")) == 1
    assert [row[0] for row in b.call("blocks_for", "b1")] == b_blocks
    daemon.audit()


def test_shrink_from_the_admin_socket(daemon: DaemonProcess, start_worker: StartWorker) -> None:
    a = start_worker(daemon.run_dir, "a")
    a.call("allocate", "k", 16 * 10, "a1")
    assert daemon.admin("shrink", stream="k", target_free=100) == {
        "stream": "k",
        "retired": 18,
        "n_free": 100,
        "n_total": 110,
    }
    assert daemon.admin("shrink", stream="k", target_free=100)["retired"] == 0
    assert a.call("n_free", "k") == 100
    daemon.audit()


def test_admin_ops_on_the_worker_socket_are_unauthorized(daemon: DaemonProcess) -> None:
    client = RawClient(daemon.run_dir)
    try:
        client.hello()
        for op in ("shrink", "sessions", "owners", "evict_session", "audit"):
            reply = client.call(op, {})
            assert not reply["ok"]
            assert reply["error"]["code"] == ErrorCode.UNAUTHORIZED, op
    finally:
        client.close()
    admin = RawClient(daemon.run_dir, "admin.sock")
    try:
        reply = admin.call("allocate", {"stream": "k", "n_tokens": 1, "owner": 1})
        assert reply["error"]["code"] == ErrorCode.UNAUTHORIZED
    finally:
        admin.close()
    assert daemon.admin("stats")["stats"]["n_allocations"] == 0


def test_requests_without_session_or_with_stale_boot_are_refused(daemon: DaemonProcess) -> None:
    client = RawClient(daemon.run_dir)
    try:
        client.hello()
        boot = client.boot
        client.boot = "0123456789abcdef"
        reply = client.call("allocate", {"stream": "k", "n_tokens": 16, "owner": 1})
        assert reply["error"]["code"] == ErrorCode.DAEMON_RESTARTED
        assert reply["boot"] == boot
        client.boot = boot
        client.sid = 12345
        reply = client.call("allocate", {"stream": "k", "n_tokens": 16, "owner": 1})
        assert reply["error"]["code"] == ErrorCode.NO_SESSION
        # Session ids read the same everywhere people see them: hex (12345 is 3039).
        assert "no session 3039 " in reply["error"]["message"]
    finally:
        client.close()
    assert daemon.admin("stats")["stats"]["n_allocations"] == 0


def test_hello_with_a_pid_that_is_not_running_is_refused(daemon: DaemonProcess) -> None:
    client = RawClient(daemon.run_dir)
    try:
        reply = client.call("hello", {"pid": 2**31 - 7, "model": "m", "nonce": "n"})
        assert reply["error"]["code"] == ErrorCode.INVALID_VALUE
        assert "not a running process" in reply["error"]["message"]
    finally:
        client.close()
    assert daemon.admin("stats")["sessions"] == 0
