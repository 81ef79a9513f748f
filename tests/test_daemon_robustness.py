"""Bad input, lost replies, slow readers and restarts: the daemon stays correct and responsive."""

from __future__ import annotations

import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from daemon_harness import AgentProcess, RawClient, wait_until
from vqpool.shared import Block, DaemonUnavailableError
from vqpool.shared.config import WORKER_SOCKET_NAME
from vqpool.shared.errors import ErrorCode
from vqpool.shared.protocol import MAX_MESSAGE_BYTES, encode_request
from vqpool.worker import PoolClient
from vqpool.worker.testing.launch import DaemonProcess

StartDaemon = Callable[..., DaemonProcess]
StartWorker = Callable[[Path, str], AgentProcess]


def pool_state(daemon: DaemonProcess) -> dict[str, Any]:
    stats = daemon.admin("stats")
    owners = sorted((str(o["owner"]), o["n_blocks"], o["tokens"]) for o in daemon.admin("owners"))
    return {
        "stats": stats["stats"],
        "streams": stats["streams"],
        "owners": owners,
        "sessions": stats["sessions"],
    }


def malformed_messages(rng: random.Random, sid: int, boot: str) -> list[list[bytes]]:
    """10,000 bad requests of every kind, each as the frames a DEALER sends."""
    valid = encode_request(1, "allocate", {"stream": "k", "n_tokens": 16, "owner": 1}, sid, boot)
    wrong_types: list[dict[str, Any]] = [
        {"v": 1, "id": "7", "op": "ping", "sid": sid, "boot": boot},
        {"v": 1, "id": 7, "op": 5, "sid": sid, "boot": boot},
        {"v": "1", "id": 7, "op": "ping"},
        {"v": 1, "id": -1, "op": "ping", "sid": sid, "boot": boot},
        {"v": 1, "id": 7, "op": "allocate", "sid": sid, "boot": boot, "args": []},
        {
            "v": 1,
            "id": 7,
            "op": "allocate",
            "sid": sid,
            "boot": boot,
            "args": {"stream": "k", "n_tokens": "16", "owner": 1},
        },
        {
            "v": 1,
            "id": 7,
            "op": "allocate",
            "sid": sid,
            "boot": boot,
            "args": {"stream": "k", "n_tokens": 16, "owner": 1.5},
        },
        {
            "v": 1,
            "id": 7,
            "op": "allocate",
            "sid": sid,
            "boot": boot,
            "args": {"stream": "k", "n_tokens": 16, "owner": "x" * 500},
        },
        {
            "v": 1,
            "id": 7,
            "op": "allocate",
            "sid": sid,
            "boot": boot,
            "args": {"stream": "k", "n_tokens": 2**64 - 1, "owner": 1},
        },
        {"v": 1, "id": 7, "op": "free", "sid": sid, "boot": boot, "args": {"block_ids": [-1]}},
        {"v": 1, "id": 7, "op": "free", "sid": sid, "boot": boot, "args": {"block_ids": "ab"}},
        {
            "v": 1,
            "id": 7,
            "op": "mark_used",
            "sid": sid,
            "boot": boot,
            "args": {"updates": [[1, 2, 3]]},
        },
        {
            "v": 1,
            "id": 7,
            "op": "allocate_many",
            "sid": sid,
            "boot": boot,
            "args": {"items": [["k", 16]]},
        },
        {"v": 1, "id": 7, "op": "ping", "sid": sid, "boot": boot, "args": {"extra": 1}},
        {"v": 1, "id": 7, "op": "ping", "sid": sid, "boot": boot, "surprise": True},
        {"v": 2, "id": 7, "op": "ping", "sid": sid, "boot": boot},
        {"v": 1, "id": 7, "op": "hello", "args": {"pid": "me", "model": "m", "nonce": "n"}},
        {"v": 1, "id": 7, "op": "hello", "args": {"pid": 1, "model": "m"}},
        {
            "v": 1,
            "id": 7,
            "op": "shrink",
            "sid": sid,
            "boot": boot,
            "args": {"stream": "k", "target_free": 0},
        },
    ]
    huge_lengths = [
        b"\xdd\xff\xff\xff\xff",  # array32 claiming 4G items
        b"\xdf\xff\xff\xff\xff",  # map32 claiming 4G pairs
        b"\xdb\xff\xff\xff\xff" + b"a" * 10,  # str32 claiming 4 GiB
        b"\xc6\x7f\xff\xff\xff",  # bin32
        b"\xc9\x7f\xff\xff\xff\x01",  # ext32
        b"\x91" * 5000,  # nesting deeper than the unpacker allows
        msgpack.packb(
            {
                "v": 1,
                "id": 1,
                "op": "free",
                "sid": sid,
                "boot": boot,
                "args": {"block_ids": list(range(70_000))},
            }
        ),
    ]
    messages: list[list[bytes]] = []
    for i in range(10_000):
        kind = i % 7
        if kind == 0:
            messages.append([rng.randbytes(rng.randrange(0, 200))])
        elif kind == 1:
            messages.append([valid[: rng.randrange(1, len(valid))]])
        elif kind == 2:
            messages.append([msgpack.packb(rng.choice(wrong_types))])
        elif kind == 3:
            messages.append([rng.choice(huge_lengths)])
        elif kind == 4:
            op = "".join(rng.choices("abcdefgh_", k=rng.randrange(1, 20)))
            messages.append([encode_request(i, op, {}, sid, boot)])
        elif kind == 5:
            messages.append([b"", valid, rng.randbytes(8)])  # wrong frame count
        elif i % 700 == 6:
            messages.append([b"\x00" * (MAX_MESSAGE_BYTES + 1)])  # over ZMQ_MAXMSGSIZE
        else:
            messages.append([valid + rng.randbytes(3)])  # trailing bytes
    return messages


def _drain(sock: zmq.Socket[bytes]) -> None:
    while sock.poll(0):
        sock.recv()


def _send_reading_replies(sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
    """Send ``frames``, reading replies while the send would block. An over-size message makes
    the daemon drop the connection, and a DEALER with no connection blocks in send until it
    reconnects. Once under load the client never did: its end of the closed connection still
    held 135 unread bytes and the send blocked for minutes. Reading what was answered lets its
    ZeroMQ see the close (a real client reads its replies too)."""
    deadline = time.monotonic() + 60.0
    while True:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
            return
        except zmq.Again:
            assert time.monotonic() < deadline, "the daemon took no message for 60 s"
            _drain(sock)
            sock.poll(50, zmq.POLLOUT)


def test_ten_thousand_malformed_messages_change_nothing(
    daemon: DaemonProcess, start_worker: StartWorker
) -> None:
    worker = start_worker(daemon.run_dir, "bystander")
    held = worker.call("allocate", "k", 100, "keep")
    worker.call("register_owner", "empty")
    attacker = RawClient(daemon.run_dir)
    attacker.hello()
    assert attacker.sid is not None and attacker.boot is not None
    before = pool_state(daemon)
    rss_before = daemon.rss()
    rng = random.Random(1234)
    messages = malformed_messages(rng, attacker.sid, attacker.boot)
    for i, frames in enumerate(messages):
        _send_reading_replies(attacker.socket, frames)
        if i % 200 == 199:  # keep the pace of a real client: collect what was answered
            _drain(attacker.socket)
    # Garbage that is not even ZMTP, straight onto the Unix socket.
    for _ in range(200):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.connect(str(daemon.run_dir / WORKER_SOCKET_NAME))
            raw.sendall(rng.randbytes(rng.randrange(1, 600)))
    # Closing drops what the attacker's socket still queues (linger 0): let it all arrive first.
    wait_until(lambda: daemon.admin("stats")["bad_requests"] >= 9_000, 10.0)
    attacker.close()
    assert daemon.admin("ping")["pid"] == daemon.pid
    assert worker.call("ping") is None
    after = pool_state(daemon)
    assert after == before
    assert [row[0] for row in worker.call("blocks_for", "keep")] == held
    assert daemon.admin("stats")["bad_requests"] >= 9_000
    growth = daemon.rss() - rss_before
    assert growth < 5 * 2**20, f"daemon RSS grew by {growth / 2**20:.1f} MiB"
    daemon.audit()


def test_resent_request_gets_the_first_reply_and_leaks_nothing(daemon: DaemonProcess) -> None:
    client = RawClient(daemon.run_dir)
    client.hello()
    try:
        for i in range(50):
            payload = client.encode("allocate", {"stream": "k", "n_tokens": 32, "owner": i})
            client.send(payload)
            # Odd rounds read the first reply and resend anyway; even rounds lose it: the socket
            # is dropped before reading.
            first = client.recv() if i % 2 else None
            client.reopen()
            client.send(payload)
            second = client.recv()
            assert second["ok"] and len(second["result"]) == 2, second
            if first is not None:
                assert first == second
        stats = daemon.admin("stats")["stats"]
        assert stats["blocks_in_use"] == 100 and stats["n_allocations"] == 100
        for i in range(50):
            assert client.call("free_all", {"owner": i})["ok"]
        assert daemon.admin("stats")["stats"]["blocks_in_use"] == 0
    finally:
        client.close()
    daemon.audit()


def test_request_older_than_the_reply_cache_is_refused(daemon: DaemonProcess) -> None:
    client = RawClient(daemon.run_dir)
    client.hello()
    try:
        first = client.encode("allocate", {"stream": "k", "n_tokens": 16, "owner": "old"})
        client.send(first)
        assert client.recv()["ok"]
        for i in range(100):
            assert client.call("register_owner", {"owner": i})["ok"]
        client.send(first)
        reply = client.recv()
        assert reply["error"]["code"] == ErrorCode.BAD_REQUEST
        assert "older than this session's reply cache" in reply["error"]["message"]
        assert daemon.admin("stats")["stats"]["blocks_in_use"] == 1
    finally:
        client.close()


def test_pool_client_resends_through_a_frozen_daemon_without_leaking(
    daemon: DaemonProcess,
) -> None:
    with PoolClient(daemon.run_dir, name="patient", timeout=10.0) as pool:
        pool.allocate("k", 16, "warm")
        resends_before = pool._connection.n_resends
        os.kill(daemon.pid, signal.SIGSTOP)
        thaw = threading.Timer(1.3, os.kill, (daemon.pid, signal.SIGCONT))
        thaw.start()
        try:
            blocks = pool.allocate("k", 48, "through-the-freeze")
        finally:
            thaw.join()
        assert pool._connection.n_resends > resends_before  # it really retried
        assert len(blocks) == 3
        stats = daemon.admin("stats")["stats"]
        assert stats["n_allocations"] == 4 and stats["blocks_in_use"] == 4
    daemon.audit()


def test_pool_client_deadline_names_the_run_dir(run_dir: Path) -> None:
    started = time.monotonic()
    with pytest.raises(DaemonUnavailableError) as caught:
        PoolClient(run_dir, name="lonely", timeout=0.6)
    assert time.monotonic() - started < 2.0
    assert str(run_dir) in str(caught.value)
    assert "Is vqpoold running" in str(caught.value)


def test_restarted_daemon_refuses_stale_requests_and_the_client_resyncs(
    start_daemon: StartDaemon,
) -> None:
    """Requests stamped with the old boot id are refused, not applied; a PoolClient re-declares
    its blocks and carries on (docs/reliability.md; tests/test_daemon_restart.py has more)."""
    daemon = start_daemon("--n-blocks", "64")
    pool = PoolClient(daemon.run_dir, name="survivor", timeout=3.0)
    raw = RawClient(daemon.run_dir)
    try:
        raw.hello()
        blocks = pool.allocate("k", 32, "before")
        daemon.stop()
        restarted = start_daemon("--n-blocks", "64", run_dir=daemon.run_dir)
        stale = raw.call("allocate", {"stream": "k", "n_tokens": 16, "owner": "stale"})
        assert stale["error"]["code"] == ErrorCode.DAEMON_RESTARTED
        assert stale["boot"] != raw.boot
        assert pool.blocks_for("before") == blocks
        pool.free(blocks)
        stats = restarted.admin("stats")
        assert stats["stats"]["n_allocations"] == 2  # the two claimed blocks, nothing else
        assert stats["stats"]["blocks_in_use"] == 0
    finally:
        raw.close()
        pool.close()


def test_pool_client_from_many_threads(daemon: DaemonProcess) -> None:
    errors: list[BaseException] = []
    with PoolClient(daemon.run_dir, name="threads") as pool:

        def churn(thread: int) -> None:
            try:
                for i in range(100):
                    owner = f"t{thread}-{i}"
                    blocks = pool.allocate("k", 40, owner)
                    pool.mark_used(blocks[-1], 16)
                    assert [b.block_id for b in pool.blocks_for(owner)] == [
                        b.block_id for b in blocks
                    ]
                    if i % 2:
                        pool.free(blocks)
                    else:
                        pool.free_all(owner)
                    assert all(b.owner is None for b in blocks)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=churn, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        assert list(pool.held_blocks()) == []
        assert pool.stats.blocks_in_use() == 0
    daemon.audit()


FLOODER = """
import os, sys, zmq
from vqpool.shared.protocol import encode_request, decode_reply
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.connect(sys.argv[1])
sock.send(encode_request(1, "hello", {"pid": os.getpid(), "model": "flood", "nonce": "flood"}))
hello = decode_reply(sock.recv())["result"]
sys.stdout.write("ready\\n"); sys.stdout.flush()
i = 2
while True:  # never reads another reply
    sock.send(encode_request(i, "n_free", {"stream": "k"}, hello["sid"], hello["boot"]))
    i += 1
"""


def test_client_that_never_reads_does_not_slow_the_others(daemon: DaemonProcess) -> None:
    flooder = subprocess.Popen(
        [sys.executable, "-c", FLOODER, f"ipc://{daemon.run_dir / WORKER_SOCKET_NAME}"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert flooder.stdout is not None and flooder.stdout.readline() == "ready\n"
        time.sleep(1.0)  # long enough for its queues to fill and replies to start dropping
        client = RawClient(daemon.run_dir)
        client.hello()
        latencies = []
        try:
            for _ in range(2000):
                started = time.perf_counter()
                reply = client.call("ping")
                latencies.append(time.perf_counter() - started)
                assert reply["ok"]
        finally:
            client.close()
        p99 = statistics.quantiles(latencies, n=100)[98]
        # A daemon that blocked on the flooder's full queue would answer in seconds, or never;
        # 50 ms leaves room for a loaded 2-core machine (flooder, daemon and this loop share it).
        assert p99 < 0.050, f"p99 {p99 * 1000:.2f} ms with a non-reading client"
        assert daemon.admin("stats")["replies_dropped"] > 0
    finally:
        flooder.kill()
        flooder.wait()


def test_block_objects_from_the_client_are_plain_blocks(daemon: DaemonProcess) -> None:
    with PoolClient(daemon.run_dir, name="types") as pool:
        blocks = pool.allocate("v", 20, 99, "int4")
        assert all(isinstance(b, Block) for b in blocks)
        assert [(b.stream, b.format, b.n_used, b.owner) for b in blocks] == [
            ("v", "int4", 16, 99),
            ("v", "int4", 4, 99),
        ]
