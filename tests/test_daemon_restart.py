"""Daemon restarts: workers re-declare what they hold, the claim period, conflicts, stale boots.

Real processes throughout: a vqpoold subprocess SIGKILLed and started again on the same run
directory, worker subprocesses holding PoolClients (tests/worker_agent.py), and raw DEALER
clients for the claim op's edge cases. docs/reliability.md describes the design.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import AgentError, AgentProcess, RawClient, wait_until
from vqpool.shared import DaemonRestartedError
from vqpool.shared.errors import ClaimConflictError, ErrorCode, RetryLaterError
from vqpool.worker import PoolClient
from vqpool.worker.testing.launch import DaemonProcess

StartDaemon = Callable[..., DaemonProcess]
StartWorker = Callable[[Path, str], AgentProcess]


def owners_view(daemon: DaemonProcess) -> dict[Any, tuple[int, int, dict[str, int], int]]:
    """owner -> (worker pid, blocks, blocks per stream, tokens): what survives a restart."""
    return {
        row["owner"]: (row["pid"], row["n_blocks"], row["blocks"], row["tokens"])
        for row in daemon.admin("owners")
    }


def claims(daemon: DaemonProcess) -> dict[str, Any]:
    result: dict[str, Any] = daemon.admin("stats")["claims"]
    return result


def restart(daemon: DaemonProcess, start_daemon: StartDaemon, *args: str) -> DaemonProcess:
    """SIGKILL ``daemon`` and start a new one on its run directory with ``args``."""
    daemon.stop(signal.SIGKILL)
    return start_daemon(*args, run_dir=daemon.run_dir)


def test_live_workers_take_back_their_blocks_and_dead_ones_leave_nothing(
    start_daemon: StartDaemon, start_worker: StartWorker
) -> None:
    options = ("--n-blocks", "64", "--lease", "1", "--claim-grace", "5")
    daemon = start_daemon(*options)
    w1, w2, w3 = (start_worker(daemon.run_dir, name) for name in ("one", "two", "three"))
    a1 = w1.call("allocate", "k", 40, "a1", "int4")
    w1.call("mark_used", [[a1[0], 7]])
    w1.call("register_owner", "a2")  # holds no block: re-declared all the same
    w1.call("allocate_many", [["v", 20, "a3", "fp16"]])
    w2.call("allocate", "k", 16, "b1")
    w2.call("allocate", "v", 33, 42)
    w3.call("allocate", "k", 48, "c1")
    before = owners_view(daemon)
    held_before = {o: w1.call("blocks_for", o) for o in ("a1", "a2", "a3")}

    daemon.stop(signal.SIGKILL)
    w3.kill()  # dies while the daemon is down: it never comes back
    started = time.monotonic()
    daemon = start_daemon(*options, run_dir=daemon.run_dir)
    # The period ends as soon as both live workers re-synced (heartbeat every 0.25 s here),
    # well before the 5 s grace.
    wait_until(lambda: not claims(daemon)["active"], timeout=4.0)
    served_after = time.monotonic() - started
    report = claims(daemon)
    assert report["period"] and report["expected"] == 2 and report["resynced"] == 2
    assert (report["owners_claimed"], report["owners_refused"]) == (5, 0)
    assert report["blocks_claimed"] == 3 + 2 + 1 + 3
    assert owners_view(daemon) == {o: v for o, v in before.items() if o != "c1"}
    assert {o: w1.call("blocks_for", o) for o in ("a1", "a2", "a3")} == held_before
    assert daemon.audit()["blocks_in_use"] == 9
    print(f"\nrestart: daemon start to claim period over {served_after:.3f}s, {report}")

    # Both carry on: new allocations, frees; nothing of the dead worker anywhere.
    assert len(w2.call("allocate", "k", 16, "b1")) == 1
    w1.call("free_all", "a1")
    w1.call("release_owner", "a2")
    for worker in (w1, w2):
        worker.call("close")
    assert daemon.audit()["blocks_in_use"] == 0


def test_claim_period_holds_allocations_and_a_worker_back_after_it_loses_its_owners(
    start_daemon: StartDaemon, start_worker: StartWorker
) -> None:
    # k ids 0..7, v ids 8..15. A long lease: the stopped worker is not reaped meanwhile.
    options = ("--n-blocks", "16", "--lease", "30", "--claim-grace", "1.5")
    daemon = start_daemon(*options)
    late, other = start_worker(daemon.run_dir, "late"), start_worker(daemon.run_dir, "other")
    late_k = late.call("allocate", "k", 64, "late-k")
    late_v = late.call("allocate", "v", 16, "late-v")
    other.call("allocate", "k", 16, "other")
    late.kill(signal.SIGSTOP)
    try:
        daemon = restart(daemon, start_daemon, *options)
        raw = RawClient(daemon.run_dir)
        try:
            raw.hello()
            reply = raw.call("allocate", {"stream": "v", "n_tokens": 1, "owner": "raw"})
            assert reply["error"]["code"] == ErrorCode.RETRY_LATER, reply
            assert "retry" in reply["error"]["message"]
        finally:
            raw.close()
        with pytest.raises(RetryLaterError):  # could retire a block about to be claimed
            daemon.admin("shrink", stream="k", target_free=0)
        # PoolClient waits the period out by itself: the stopped worker never claims.
        started = time.monotonic()
        more = other.call("allocate", "k", 7 * 16, "other-2")  # every free k block
        waited = time.monotonic() - started
        assert 0.5 < waited < 5.0
        assert set(more) >= set(late_k), "the late worker's k ids were free to hand out"
        report = claims(daemon)
        assert not report["active"] and "ran out" in report["end_reason"]
    finally:
        late.kill(signal.SIGCONT)
    # The late worker's heartbeat re-syncs it, after the period: its claims are refused (a
    # claim outside a claim period could take any free block, past the budget), so both of
    # its owners are lost, the one whose blocks are free as well as the one whose are not.
    wait_until(lambda: claims(daemon)["owners_refused"] == 2, timeout=5.0)
    for owner in ("late-k", "late-v"):
        with pytest.raises(AgentError) as lost:
            late.call("allocate", "k", 16, owner)
        assert lost.value.kind == "ClaimConflictError"
        assert "lost in a vqpoold restart" in str(lost.value)
        assert "claim period" in str(lost.value)
    with pytest.raises(AgentError, match="ClaimConflictError"):
        late.call("free", late_k)  # its blocks are another owner's now: not freed
    assert set(late.call("lost_owners")) == {"late-k", "late-v"}
    late.call("free_all", "late-k")  # forgets it
    late.call("free_all", "late-v")
    assert late.call("lost_owners") == {}
    assert late.call("allocate", "v", 16, "late-k") == late_v  # the id can be used again
    assert owners_view(daemon)["other-2"][1] == 7
    daemon.audit()
    late.call("close")
    other.call("close")
    assert daemon.audit()["blocks_in_use"] == 0


def test_claims_are_per_owner_all_or_nothing_and_first_come(start_daemon: StartDaemon) -> None:
    # Two sessions of this process on the roll, then a restart: both may claim in its period.
    options = ("--n-blocks", "256", "--lease", "30", "--claim-grace", "10")
    daemon = start_daemon(*options)
    first, second = RawClient(daemon.run_dir), RawClient(daemon.run_dir)
    try:
        sids = []
        for index, client in enumerate((first, second)):
            client.hello()
            assert client.call("register_owner", {"owner": f"on-the-roll-{index}"})["ok"]
            sids.append(client.sid)
        daemon = restart(daemon, start_daemon, *options)
        for client, sid in zip((first, second), sids, strict=True):
            client.reopen()
            client.hello(resumes=sid)

        def claim(client: RawClient, owners: list[Any]) -> list[Any]:
            reply = client.call("claim", {"owners": owners, "done": False})
            assert reply["ok"], reply
            return list(reply["result"])

        assert claim(first, [["x", [["k", "fp16", [1, 2], [16, 5]]]]]) == [None]
        results = claim(
            second,
            [
                ["y", [["k", "fp16", [3], None], ["k", "fp16", [2], None]]],  # 2 is x's
                ["x", [["k", "fp16", [4], None]]],  # x is held by the first session
                ["z", [["k", "fp16", [10_000], None]]],  # not in the pool
                ["w", [["k", "fp16", [200], None]]],  # a v id (k is 0..127)
                ["u", [["k", "fp16", [5], [99]]]],  # fill beyond the block size
                ["ok", [["v", "int4", [130, 131], None], ["k", "fp16", [6], [0]]]],
                ["registered", []],
            ],
        )
        codes = [None if r is None else r["code"] for r in results]
        assert codes == [
            ErrorCode.CLAIM_CONFLICT,
            ErrorCode.CLAIM_CONFLICT,
            ErrorCode.CLAIM_CONFLICT,
            ErrorCode.CLAIM_CONFLICT,
            ErrorCode.INVALID_VALUE,
            None,
            None,
        ]
        view = owners_view(daemon)
        assert set(view) == {"x", "ok", "registered"}  # y left nothing behind (3 is free)
        assert view["ok"][2] == {"v": 2, "k": 1}
        assert view["x"][3] == 21
        # A resent claim (same request id) gets its first reply, not a second application.
        payload = second.encode(
            "claim", {"owners": [["again", [["k", "fp16", [7], None]]]], "done": False}
        )
        second.send(payload)
        once = second.recv()
        second.send(payload)
        assert second.recv() == once and once["result"] == [None]
        assert daemon.audit()["blocks_in_use"] == 2 + 3 + 1
        stats = claims(daemon)
        assert (stats["owners_claimed"], stats["owners_refused"]) == (4, 5)
        assert stats["active"]  # neither session has sent its done
    finally:
        first.close()
        second.close()


def test_restart_with_another_pool_refuses_what_does_not_fit(start_daemon: StartDaemon) -> None:
    daemon = start_daemon("--n-blocks", "64", "--lease", "1")
    pool = PoolClient(daemon.run_dir, name="resized", timeout=5.0)
    try:
        high = pool.allocate("k", 32, "high")  # k ids 31, 30
        low = pool.allocate("v", 16, "low")  # v id 63
        pool.allocate("k", 29 * 16, "filler")  # k ids 29..1
        pool.free_all("filler")
        pool.allocate("k", 16, "one")  # id 1 again: in both pools' k range
        daemon = restart(daemon, start_daemon, "--n-blocks", "32", "--lease", "1")
        # k is now 0..15 and v 16..31: ids 30, 31 are v blocks and 63 is beyond the pool.
        assert pool.blocks_for("one")[0].block_id == 1
        for owner in ("high", "low"):
            with pytest.raises(ClaimConflictError, match="not a block of stream"):
                pool.blocks_for(owner)
        assert set(pool.lost_owners()) == {"high", "low"}
        assert high[0].owner is None and low[0].owner is None
        assert claims(daemon)["owners_refused"] == 2
        daemon.audit()
        # A pool with another block size cannot take any claim: the client stops for good.
        daemon = restart(daemon, start_daemon, "--n-blocks", "32", "--block-size", "8")
        with pytest.raises(DaemonRestartedError, match="another pool"):
            pool.n_free("k")
        with pytest.raises(DaemonRestartedError):
            pool.n_free("k")
    finally:
        pool.close()


def test_two_clients_in_one_process_both_keep_their_blocks_through_a_restart(
    start_daemon: StartDaemon, start_worker: StartWorker
) -> None:
    # Two models in one process: two PoolClients, two sessions, one pid. k ids 0..7. A 10 s grace
    # (heartbeat every 2.5 s): the second client re-syncs well after the first one.
    options = ("--n-blocks", "16", "--lease", "30", "--claim-grace", "10")
    daemon = start_daemon(*options)
    # The other worker's process starts first: a slow start after the clients could outlast the
    # second client's first heartbeat, which would then re-sync it on its own.
    other = start_worker(daemon.run_dir, "other")
    first = PoolClient(daemon.run_dir, name="model-a", timeout=15.0)
    second = PoolClient(daemon.run_dir, name="model-b", timeout=15.0)
    try:
        first.allocate("k", 16, "a")
        held = [b.block_id for b in second.allocate("k", 32, "b")]
        daemon = restart(daemon, start_daemon, *options)
        first.ping()  # re-syncs the first client only: its process is not done yet
        assert claims(daemon)["active"], "the period ended with a session of the process missing"
        # The other worker takes every k block it can get: it must wait for the second client's
        # claims (RETRY_LATER), then find its blocks taken back.
        taken: list[int] = []
        with pytest.raises(AgentError, match="BlockPoolExhaustedError"):
            while True:
                taken += other.call("allocate", "k", 16, f"o{len(taken)}")
        assert not set(taken) & set(held)
        assert second.lost_owners() == {}
        assert [b.block_id for b in second.blocks_for("b")] == held
        report = claims(daemon)
        # Both clients were expected (the other worker too if the roll listed it already: it
        # held nothing, so it need not be) and all came back; nothing was refused.
        assert report["owners_refused"] == 0
        assert report["resynced"] == report["expected"] >= 2
        assert daemon.audit()["blocks_in_use"] == 8
        print(f"\ntwo clients in one process: {len(held)} block(s) kept, {report}")
    finally:
        first.close()
        second.close()


def test_a_pool_grown_past_its_first_id_space_keeps_every_owner_through_a_restart(
    start_daemon: StartDaemon,
) -> None:
    # A budget and no --n-blocks: the id space starts at 1,024 ids (512 per stream) and grows
    # under load, up to what the budget allows. 15 owners x 100 k blocks (4 KiB each, 6 MiB of
    # the 8 MiB budget): most of their ids are grown ids, past the first id space.
    options = ("--budget", "8MiB", "--lease", "30", "--claim-grace", "5")
    daemon = start_daemon(*options)
    pool = PoolClient(daemon.run_dir, name="grown", bytes_per_block=4096, timeout=10.0)
    try:
        owners = [f"r{i}" for i in range(15)]
        held = {owner: pool.allocate("k", 100 * 16, owner) for owner in owners}
        ids = {b.block_id for blocks in held.values() for b in blocks}
        assert len(ids) == 1500 and max(ids) >= 1024, "the pool did not grow"
        before = owners_view(daemon)

        daemon = restart(daemon, start_daemon, *options)
        pool.ping()  # re-syncs: hello and claims
        assert pool.lost_owners() == {}
        for owner in owners:
            assert [b.block_id for b in pool.blocks_for(owner)] == [b.block_id for b in held[owner]]
        assert owners_view(daemon) == before
        report = claims(daemon)
        assert (report["owners_claimed"], report["owners_refused"]) == (15, 0)
        assert report["blocks_claimed"] == 1500
        audit = daemon.audit()
        assert audit["blocks_in_use"] == 1500
        # The pool carries on: it grows again from what the claims left free, and frees work.
        more = pool.allocate("k", 300 * 16, "after")
        assert not {b.block_id for b in more} & ids
        for owner in owners:
            pool.free_all(owner)
        pool.free_all("after")
        assert daemon.audit()["blocks_in_use"] == 0
        print(f"\ngrown pool restart: {len(ids)} blocks of {len(owners)} owners kept, {report}")
    finally:
        pool.close()
