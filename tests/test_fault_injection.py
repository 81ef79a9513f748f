"""Lost, duplicated, delayed and reordered messages between PoolClients and vqpoold.

Three clients in threads of this process talk to a real daemon through FaultyProxy
(tests/fault_proxy.py), which drops, duplicates and delays requests and replies. Every call
must take effect exactly once or raise; no block may be leaked or given to two owners.
"""

from __future__ import annotations

import contextlib
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from daemon_harness import remove_tree, short_tmpdir, wait_until
from fault_proxy import FaultyProxy
from vqpool.shared import Block, BlockPoolExhaustedError, DaemonUnavailableError
from vqpool.worker import PoolClient
from vqpool.worker.testing.launch import DaemonProcess

N_CLIENTS = 3
N_OPS = 80


def drive(pool: PoolClient, seed: int, tally: Counter[str], errors: list[BaseException]) -> None:
    """Random allocate / free / mark_used / free_all on this client's own owners; checks the
    client's view against the daemon's after every change it is sure about."""
    rng = random.Random(seed)
    held: dict[str, list[Block]] = {}
    try:
        for i in range(N_OPS):
            op = rng.choice(["allocate", "allocate", "free", "mark_used", "free_all"])
            try:
                if op == "allocate" or not held:
                    owner = rng.choice([*held, f"c{seed}-{i}"])
                    n_tokens = rng.randint(1, 48)
                    blocks = pool.allocate(rng.choice("kv"), n_tokens, owner)
                    tally["blocks allocated"] += len(blocks)
                    held.setdefault(owner, []).extend(blocks)
                elif op == "free":
                    owner = rng.choice(list(held))
                    chosen = rng.sample(held[owner], rng.randint(1, len(held[owner])))
                    pool.free(chosen)
                    held[owner] = [b for b in held[owner] if b not in chosen]
                    if not held[owner]:
                        del held[owner]
                elif op == "mark_used":
                    owner = rng.choice(list(held))
                    block = rng.choice(held[owner])
                    pool.mark_used(block, rng.randint(0, 16))
                else:
                    owner = rng.choice(list(held))
                    pool.free_all(owner)
                    del held[owner]
                tally["calls ok"] += 1
            except BlockPoolExhaustedError:
                tally["exhausted"] += 1
            except DaemonUnavailableError:
                tally["calls raised"] += 1
                return  # the effect is unknown: stop here, the final audit still holds
            # The daemon's view of what this client holds equals the client's own.
            for owner, blocks in held.items():
                theirs = sorted(b.block_id for b in pool.blocks_for(owner))
                assert theirs == sorted(b.block_id for b in blocks), (owner, theirs)
        for owner in list(held):
            pool.free_all(owner)
    except BaseException as exc:
        errors.append(exc)


def test_lost_duplicated_and_delayed_messages_leak_nothing_and_apply_once(
    daemon: DaemonProcess,
) -> None:
    proxy_base = short_tmpdir()
    proxy_dir = proxy_base / "run"
    proxy_dir.mkdir(mode=0o700)
    proxy = FaultyProxy(
        proxy_dir, daemon.run_dir, drop=0.08, duplicate=0.08, delay=0.15, max_delay=0.15, seed=3
    ).start_and_wait()
    tally: Counter[str] = Counter()
    errors: list[BaseException] = []
    # A first resend after 50 ms, inside the proxy's delays (up to 150 ms): lost messages cost
    # less waiting, and more resends race a delayed original (still applied once).
    clients = [
        PoolClient(proxy_dir, name=f"faulty-{i}", timeout=20.0, first_retry=0.05)
        for i in range(N_CLIENTS)
    ]
    try:
        threads = [
            threading.Thread(target=drive, args=(pool, seed, tally, errors))
            for seed, pool in enumerate(clients)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not errors, errors
        assert tally["calls raised"] == 0, tally  # generous deadlines: every call got through
        # A free made while a client's heartbeat found the daemon silent (its pings lost to the
        # proxy) is kept and sent once a ping is answered again: wait until none is kept.
        wait_until(lambda: all(pool.calls_kept == 0 for pool in clients), timeout=30.0)
        stats = daemon.admin("stats")["stats"]
        # Each successful allocation was applied once: no resend or duplicate allocated again.
        assert stats["n_allocations"] == tally["blocks allocated"]
        assert stats["blocks_in_use"] == 0, "blocks leaked"
        daemon.audit()
        faults = proxy.counts
        for kind in ("requests", "replies"):
            for fault in ("dropped", "duplicated", "delayed"):
                assert faults[f"{kind} {fault}"] > 0, (kind, fault, faults)
        print(f"\nfault injection: {dict(tally)}; proxy: {dict(faults)}")
    finally:
        for pool in clients:
            pool.close()
        proxy.stop()
        remove_tree(Path(proxy_base))


def test_a_resync_cut_short_by_lost_claims_is_finished_before_the_blocks_are_used(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    # k ids 0..7. The client's deadline (1 s) is shorter than the claim grace (5 s).
    options = ("--n-blocks", "16", "--lease", "30", "--claim-grace", "5")
    daemon = start_daemon(*options)
    proxy_base = short_tmpdir()
    proxy_dir = proxy_base / "run"
    proxy_dir.mkdir(mode=0o700)
    proxy = FaultyProxy(proxy_dir, daemon.run_dir, drop=0, duplicate=0, delay=0).start_and_wait()
    pool = PoolClient(proxy_dir, name="cut-short", timeout=1.0, first_retry=0.1)
    other: PoolClient | None = None
    try:
        mine = {b.block_id for b in pool.allocate("k", 64, "mine")}
        daemon.stop(signal.SIGKILL)
        proxy.drop_ops = {"claim"}  # the new daemon answers hello, but no claim reaches it
        daemon = start_daemon(*options, run_dir=daemon.run_dir)
        # The re-sync (by this call or the heartbeat) says hello, then times out claiming.
        with contextlib.suppress(DaemonUnavailableError):
            pool.n_free("k")
        wait_until(lambda: proxy.counts["requests dropped"] > 0, timeout=3.0)
        time.sleep(1.2)  # past the deadline of any re-sync in flight
        proxy.drop_ops = set()
        pool.ping()
        # Whatever the client still takes for its own, the daemon holds for it.
        held = {b.block_id for b in pool.held_blocks()}
        assert held <= mine
        if held:
            assert {b.block_id for b in pool.blocks_for("mine")} == held
        wait_until(lambda: not daemon.admin("stats")["claims"]["active"], timeout=8.0)
        other = PoolClient(daemon.run_dir, name="other")
        n_free = other.n_free("k")
        taken = set()
        if n_free:
            taken = {b.block_id for b in other.allocate("k", n_free * 16, "theirs")}
        assert not taken & held, f"blocks {sorted(taken & held)} given to two owners"
        assert taken | held == set(range(8))
        daemon.audit()
    finally:
        pool.close()
        if other is not None:
            other.close()
        proxy.stop()
        remove_tree(Path(proxy_base))
