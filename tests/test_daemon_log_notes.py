"""What vqpoold says about settings and events that are not errors: an odd --n-blocks split
between K and V, and the stale requests every worker sends once after a restart."""

from __future__ import annotations

import signal
from collections.abc import Callable

from daemon_harness import wait_until
from vqpool.worker import PoolClient
from vqpool.worker.testing.launch import DaemonProcess

StartDaemon = Callable[..., DaemonProcess]


def test_an_odd_block_count_for_split_pools_is_said_at_start(start_daemon: StartDaemon) -> None:
    daemon = start_daemon("--n-blocks", "7")
    streams = daemon.admin("stats")["streams"]
    assert {name: s["total"] for name, s in streams.items()} == {"k": 3, "v": 3}
    assert "--n-blocks 7 is split between keys and values: 3 each, 6 in all" in daemon.log()
    shared = start_daemon("--n-blocks", "7", "--shared-kv")
    assert "split between" not in shared.log()


def test_a_stale_boot_after_a_restart_is_info_once_not_a_bad_request_warning(
    start_daemon: StartDaemon,
) -> None:
    options = ("--n-blocks", "64", "--lease", "1", "--log-level", "DEBUG")
    daemon = start_daemon(*options)
    with PoolClient(daemon.run_dir, name="stale", timeout=10) as pool:
        pool.allocate("k", 20, "a1")
        daemon.stop(signal.SIGKILL)
        before = len(daemon.log())
        daemon = start_daemon(*options, run_dir=daemon.run_dir)
        assert len(pool.blocks_for("a1")) == 2  # re-synced
        wait_until(lambda: pool.resyncs, timeout=5)
        pool.ping()
        pool.free_all("a1")
    log = daemon.log()[before:]
    assert "bad request" not in log, log
    stale = [line for line in log.splitlines() if "previous lifetime" in line]
    assert len([line for line in stale if " INFO " in line]) == 1, log
    assert all(" DEBUG " in line for line in stale if " INFO " not in line), log
    assert daemon.admin("stats")["bad_requests"] == 0
