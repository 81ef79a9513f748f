"""What one request may cost the daemon, and what a failed one may change (issue 10, 4-7).

Real vqpoold processes and raw protocol clients: a reply flood is bounded in bytes, one request
cannot ask for more than MAX_BLOCKS_PER_REQUEST blocks, a hello cannot plant values the admin
views fail to encode, and a failed allocation leaves no owner behind.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import msgpack
from ctl_harness import run_ctl
from daemon_harness import RawClient
from vqpool.shared import AllocationRequest, OwnerAlreadyActiveError
from vqpool.shared.errors import ErrorCode
from vqpool.shared.protocol import (
    MAX_BATCH,
    MAX_BLOCKS_PER_ALLOCATE,
    MAX_BLOCKS_PER_REQUEST,
    MAX_BYTES_PER_BLOCK,
    MAX_ERROR_MESSAGE_LEN,
    MAX_OWNER_LEN,
    MAX_TEXT_LEN,
)
from vqpool.worker import PoolClient
from vqpool.worker.testing.launch import DaemonProcess

StartDaemon = Callable[..., DaemonProcess]


def pool_state(daemon: DaemonProcess) -> dict[str, Any]:
    stats = daemon.admin("stats")
    owners = sorted((str(o["owner"]), o["sid"], o["n_blocks"]) for o in daemon.admin("owners"))
    return {"stats": stats["stats"], "streams": stats["streams"], "owners": owners}


def raw_session(daemon: DaemonProcess, model: str = "raw") -> RawClient:
    client = RawClient(daemon.run_dir)
    client.hello(model=model)
    return client


# -- finding 4: the reply cache is bounded in bytes, error replies are compact ---------------------


def test_reply_flood_is_bounded_in_bytes_and_retries_stay_safe(daemon: DaemonProcess) -> None:
    holder = raw_session(daemon, model="m" * MAX_TEXT_LEN)
    attacker = raw_session(daemon)
    try:
        # 4,096 owners with the longest names, held by another session: every item of the
        # attacker's allocate_many fails with OWNER_ALREADY_ACTIVE, each message different.
        owners = [f"{i:04d}".ljust(MAX_OWNER_LEN, "o") for i in range(MAX_BATCH)]
        for owner in owners:
            assert holder.call("register_owner", {"owner": owner})["ok"]
        items = [["k", 16, owner, "fp16"] for owner in owners]
        rss_before = daemon.rss()
        payloads = [attacker.encode("allocate_many", {"items": items}) for _ in range(64)]
        reply_sizes = []
        for payload in payloads:
            attacker.send(payload)
            assert attacker.socket.poll(10_000)
            raw = attacker.socket.recv()
            reply_sizes.append(len(raw))
            last_reply = raw
            result = msgpack.unpackb(raw)["result"]
            assert all(r["code"] == ErrorCode.OWNER_ALREADY_ACTIVE for r in result)
            assert max(len(r["message"]) for r in result) <= MAX_ERROR_MESSAGE_LEN
        growth = daemon.rss() - rss_before
        stats = daemon.admin("stats")
        cache = stats["reply_cache"]
        assert cache["bytes"] <= cache["bytes_per_session"] + max(reply_sizes), cache
        assert growth < 24 * 2**20, f"daemon RSS grew by {growth / 2**20:.1f} MiB"

        # The latest reply is always kept: its retry gets it byte for byte.
        attacker.send(payloads[-1])
        assert attacker.socket.poll(5000)
        assert attacker.socket.recv() == last_reply
        # An evicted one is refused, never applied again.
        attacker.send(payloads[0])
        refused = attacker.recv()
        assert refused["error"]["code"] == ErrorCode.BAD_REQUEST
        assert "older than this session's reply cache" in refused["error"]["message"]
        assert stats["stats"]["n_allocations"] == 0
    finally:
        attacker.close()
        holder.close()
    daemon.audit()


def test_items_failing_for_one_reason_share_one_message(daemon: DaemonProcess) -> None:
    holder = raw_session(daemon, model="m" * MAX_TEXT_LEN)
    attacker = raw_session(daemon)
    try:
        owner = "x" * MAX_OWNER_LEN
        assert holder.call("register_owner", {"owner": owner})["ok"]
        items = [["k", 16, owner, "fp16"]] * MAX_BATCH
        attacker.send(attacker.encode("allocate_many", {"items": items}))
        assert attacker.socket.poll(5000)
        raw = attacker.socket.recv()
        result = msgpack.unpackb(raw)["result"]
        assert "another worker session" in result[0]["message"]
        assert all(
            r == {"code": result[0]["code"], "message": "as item 0", "same_as": 0}
            for r in result[1:]
        )
        assert len(raw) < 48 * MAX_BATCH, len(raw)
    finally:
        attacker.close()
        holder.close()


def test_pool_client_spells_out_shared_item_messages(daemon: DaemonProcess) -> None:
    holder = raw_session(daemon, model="holder")
    try:
        assert holder.call("register_owner", {"owner": "taken"})["ok"]
        with PoolClient(daemon.run_dir, name="reader") as pool:
            results = pool.allocate_many([AllocationRequest("k", 16, "taken")] * 3)
        assert all(isinstance(r, OwnerAlreadyActiveError) for r in results)
        assert len({str(r) for r in results}) == 1
        assert "another worker session" in str(results[2])
    finally:
        holder.close()


# -- finding 5: blocks per request are bounded; nothing grows on a refused request -----------------


def test_allocate_many_cannot_ask_for_more_than_the_request_limit(
    start_daemon: StartDaemon,
) -> None:
    daemon = start_daemon("--n-blocks", "256", "--grow", "--lease", "1")
    client = raw_session(daemon)
    try:
        huge = [["k", MAX_BLOCKS_PER_ALLOCATE * 16, i, "fp16"] for i in range(MAX_BATCH)]
        before = pool_state(daemon)
        rss_before = daemon.rss()
        reply = client.call("allocate_many", {"items": huge})
        assert reply["error"]["code"] == ErrorCode.INVALID_VALUE, reply
        message = reply["error"]["message"]
        assert f"{MAX_BATCH * MAX_BLOCKS_PER_ALLOCATE} blocks" in message
        assert f"at most {MAX_BLOCKS_PER_REQUEST}" in message
        assert pool_state(daemon) == before
        assert daemon.rss() - rss_before < 8 * 2**20

        # One block over the limit in all, split over items: refused whole.
        quarter = MAX_BLOCKS_PER_REQUEST // 4
        items = [["k", quarter * 16, f"q{i}", "fp16"] for i in range(4)]
        over = [*items, ["v", 1, "one-more", "fp16"]]
        reply = client.call("allocate_many", {"items": over})
        assert reply["error"]["code"] == ErrorCode.INVALID_VALUE
        assert pool_state(daemon) == before
        # Exactly at the limit: served (the pool grows to fit).
        reply = client.call("allocate_many", {"items": items})
        assert reply["ok"] and [len(ids) for ids in reply["result"]] == [quarter] * 4
        assert daemon.admin("stats")["stats"]["blocks_in_use"] == MAX_BLOCKS_PER_REQUEST
    finally:
        client.close()
    daemon.audit()


# -- finding 6: bytes_per_block is bounded; the admin views always encode --------------------------


def test_hello_refuses_a_huge_bytes_per_block(daemon: DaemonProcess) -> None:
    client = RawClient(daemon.run_dir)
    try:
        for bytes_per_block in (2**63 - 1, MAX_BYTES_PER_BLOCK + 1, {"k": 1, "v": 2**62}):
            reply = client.call(
                "hello",
                {
                    "pid": os.getpid(),
                    "model": "big",
                    "nonce": os.urandom(8).hex(),
                    "bytes_per_block": bytes_per_block,
                },
            )
            assert reply["error"]["code"] == ErrorCode.BAD_REQUEST, reply
            assert str(MAX_BYTES_PER_BLOCK) in reply["error"]["message"]
        assert daemon.admin("stats")["sessions"] == 0
    finally:
        client.close()


def test_admin_sessions_view_encodes_with_the_largest_values(daemon: DaemonProcess) -> None:
    big = RawClient(daemon.run_dir)
    other = raw_session(daemon, model="other")
    try:
        reply = big.call(
            "hello",
            {
                "pid": os.getpid(),
                "model": "m" * MAX_TEXT_LEN,
                "nonce": os.urandom(8).hex(),
                "bytes_per_block": MAX_BYTES_PER_BLOCK,
            },
        )
        assert reply["ok"], reply
        big.sid, big.boot = reply["result"]["sid"], reply["result"]["boot"]
        assert big.call("allocate", {"stream": "k", "n_tokens": 64 * 16, "owner": 1})["ok"]
        assert other.call("allocate", {"stream": "v", "n_tokens": 16, "owner": 2})["ok"]
        views = {s["sid"]: s for s in daemon.admin("sessions")}
        assert views[big.sid]["bytes_total"] == 64 * MAX_BYTES_PER_BLOCK
        assert views[other.sid]["n_blocks"] == 1
        result = run_ctl(daemon.run_dir, "sessions")
        assert result.returncode == 0, result.stderr
        assert run_ctl(daemon.run_dir, "owners").returncode == 0
    finally:
        other.close()
        big.close()


# -- finding 7: a failed allocation changes no ownership -------------------------------------------


def test_failed_allocate_leaves_no_owner_behind(start_daemon: StartDaemon) -> None:
    daemon = start_daemon("--n-blocks", "8", "--lease", "1")
    a = raw_session(daemon, model="a")
    b = raw_session(daemon, model="b")
    try:
        assert a.call("allocate", {"stream": "k", "n_tokens": 3 * 16, "owner": "held"})["ok"]
        assert a.call("register_owner", {"owner": "mine"})["ok"]
        before = pool_state(daemon)
        exhausted = [
            a.call("allocate", {"stream": "k", "n_tokens": 2 * 16, "owner": "new"}),
            a.call("allocate", {"stream": "k", "n_tokens": 2 * 16, "owner": "mine"}),
            a.call("allocate", {"stream": "k", "n_tokens": 2 * 16, "owner": "held"}),
            a.call("allocate_many", {"items": [["k", 2 * 16, "new-too", "fp16"]]}),
        ]
        assert [r["error"]["code"] for r in exhausted[:3]] == [ErrorCode.POOL_EXHAUSTED] * 3
        assert exhausted[3]["result"][0]["code"] == ErrorCode.POOL_EXHAUSTED
        after = pool_state(daemon)
        assert after["stats"]["n_exhausted"] == before["stats"]["n_exhausted"] + 4
        assert after["owners"] == before["owners"]  # "mine" and "held" stay, nothing new
        # The owners the failed calls named are free for another session.
        assert b.call("register_owner", {"owner": "new"})["ok"]
        assert b.call("allocate", {"stream": "v", "n_tokens": 16, "owner": "new-too"})["ok"]
        assert b.call("register_owner", {"owner": "mine"})["error"]["code"] == (
            ErrorCode.OWNER_ALREADY_ACTIVE
        )
    finally:
        b.close()
        a.close()
    daemon.audit()
