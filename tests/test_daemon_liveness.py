"""Sessions end when their process does (or stays stopped past its lease), and only then."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from daemon_harness import AgentProcess, RawClient, wait_until
from vqpool.worker.testing.launch import DaemonProcess

StartWorker = Callable[[Path, str], AgentProcess]
LEASE = 1.0  # the daemon fixture's --lease


def blocks_of(daemon: DaemonProcess, pid: int) -> int | None:
    """Blocks held by the session of ``pid``, or None if it has no session."""
    for session in daemon.admin("sessions"):
        if session["pid"] == pid:
            return int(session["n_blocks"])
    return None


def lease_state(daemon: DaemonProcess, pid: int) -> str | None:
    """The lease state ("ok", "expired") of the session of ``pid``, or None if it has none."""
    for session in daemon.admin("sessions"):
        if session["pid"] == pid:
            return str(session["lease"]["state"])
    return None


def test_killed_worker_is_reaped_within_two_seconds(
    daemon: DaemonProcess, start_worker: StartWorker
) -> None:
    doomed = start_worker(daemon.run_dir, "doomed")
    survivor = start_worker(daemon.run_dir, "survivor")
    doomed.call("allocate", "k", 16 * 20, "d1")
    doomed.call("register_owner", "d2")
    kept = survivor.call("allocate", "k", 16 * 5, "s1")
    doomed.kill(signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(lambda: blocks_of(daemon, doomed.pid) is None, timeout=2.0)
    assert time.monotonic() - killed_at < 2.0
    stats = daemon.admin("stats")
    assert stats["stats"]["blocks_in_use"] == 5
    assert stats["sessions_reaped"] == 1
    assert [row[0] for row in survivor.call("blocks_for", "s1")] == kept
    survivor.call("register_owner", "d2")  # the dead worker's ids are free again
    daemon.audit()


def test_stopped_worker_keeps_blocks_within_lease_and_loses_them_after(
    daemon: DaemonProcess, start_worker: StartWorker
) -> None:
    worker = start_worker(daemon.run_dir, "sleepy")
    worker.call("allocate", "k", 64, "w1")
    worker.kill(signal.SIGSTOP)
    time.sleep(LEASE / 4)
    worker.kill(signal.SIGCONT)
    time.sleep(LEASE)
    assert blocks_of(daemon, worker.pid) == 4  # a short stop is forgiven
    worker.kill(signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        wait_until(lambda: blocks_of(daemon, worker.pid) is None, timeout=LEASE + 2.0)
        assert time.monotonic() - stopped_at >= LEASE / 2
    finally:
        worker.kill(signal.SIGCONT)
    assert daemon.admin("stats")["stats"]["blocks_in_use"] == 0
    daemon.audit()


def test_busy_worker_holding_the_gil_past_its_lease_is_not_reaped(
    daemon: DaemonProcess, start_worker: StartWorker
) -> None:
    worker = start_worker(daemon.run_dir, "busy")
    worker.call("allocate", "k", 64, "w1")
    assert lease_state(daemon, worker.pid) == "ok"
    with ThreadPoolExecutor(1) as hogging:
        # The hog holds the GIL until its clock says 3 leases passed (not a calibrated guess).
        hog = hogging.submit(worker.call, "hog_gil", 3 * LEASE)
        # The heartbeat really was starved past the lease: the daemon saw the worker silent.
        seen: list[str | None] = []

        def expired_or_over() -> bool:
            seen.append(lease_state(daemon, worker.pid))
            return seen[-1] == "expired" or hog.done()

        wait_until(expired_or_over, timeout=30.0)
        held = hog.result(timeout=30.0)
    assert "expired" in seen, f"the hog ended before the daemon saw the lease expire: {seen}"
    assert held >= 3 * LEASE
    assert blocks_of(daemon, worker.pid) == 4  # not reaped
    assert len(worker.call("allocate", "k", 16, "w1")) == 1
    wait_until(lambda: lease_state(daemon, worker.pid) == "ok", timeout=5.0)


def test_idle_session_with_dropped_connection_is_not_reaped(daemon: DaemonProcess) -> None:
    # This test process is the worker: alive, silent (no heartbeat), connection closed.
    client = RawClient(daemon.run_dir)
    client.hello(model="silent")
    assert client.call("allocate", {"stream": "k", "n_tokens": 48, "owner": "quiet"})["ok"]
    client.close()
    time.sleep(3 * LEASE)
    sessions = daemon.admin("sessions")
    assert [s["n_blocks"] for s in sessions if s["model"] == "silent"] == [3]
    assert sessions[0]["lease"]["state"] == "expired"
