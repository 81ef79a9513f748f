"""vqpoold survives connection floods: idle connections beyond its open-file limit must not make
libzmq abort it (libzmq 4.3 asserts when accept() fails with EMFILE), and it keeps serving."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from daemon_harness import RawClient, remove_tree, short_tmpdir, wait_until
from vqpool.shared.config import WORKER_SOCKET_NAME
from vqpool.worker.testing.launch import DaemonProcess

FLOOD = Path(__file__).with_name("connection_flood.py")
LOW_FD_LIMIT = 256


@pytest.fixture
def start_limited() -> Iterator[Callable[[int, int], DaemonProcess]]:
    """Start vqpoold with the given soft and hard RLIMIT_NOFILE (stopped afterwards)."""
    started: list[tuple[DaemonProcess, Path]] = []

    def start(soft: int, hard: int) -> DaemonProcess:
        base = short_tmpdir()
        daemon = DaemonProcess(base / "run", "--n-blocks", "64", fd_limit=(soft, hard))
        started.append((daemon.start(), base))
        return daemon

    yield start
    for daemon, base in started:
        daemon.stop()
        remove_tree(base)


def start_flood(run_dir: Path, n: int, kind: str) -> subprocess.Popen[str]:
    flood = subprocess.Popen(
        [sys.executable, str(FLOOD), f"ipc://{run_dir / WORKER_SOCKET_NAME}", str(n), kind],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert flood.stdout is not None and flood.stdout.readline().strip() == "flooding"
    return flood


def end_flood(flood: subprocess.Popen[str]) -> None:
    assert flood.stdin is not None and flood.stdout is not None
    flood.stdin.close()
    flood.wait(10)
    flood.stdout.close()


def allocates_and_frees(client: RawClient) -> bool:
    reply = client.call("allocate", {"stream": "k", "n_tokens": 16, "owner": "survivor"})
    assert reply["ok"], reply
    return bool(client.call("free_all", {"owner": "survivor"})["ok"])


@pytest.mark.parametrize("kind", ["dealer", "raw"])
def test_flood_past_the_fd_limit_leaves_the_daemon_serving(
    start_limited: Callable[[int, int], DaemonProcess], kind: str
) -> None:
    daemon = start_limited(LOW_FD_LIMIT, LOW_FD_LIMIT)
    assert daemon.process is not None
    survivor = RawClient(daemon.run_dir)
    try:
        survivor.hello()
        assert allocates_and_frees(survivor)
        flood = start_flood(daemon.run_dir, 2 * LOW_FD_LIMIT, kind)
        try:
            # It either dies (libzmq's abort) or stops accepting and says so.
            wait_until(
                lambda: daemon.process.poll() is not None or "new connections" in daemon.log(),
                timeout=15,
            )
            assert daemon.process.poll() is None, daemon.log()
            assert psutil.Process(daemon.pid).num_fds() < LOW_FD_LIMIT
            assert allocates_and_frees(survivor)
            assert daemon.admin("ping")["pid"] == daemon.pid
            assert daemon.admin("stats")["sessions"] >= 1
        finally:
            end_flood(flood)
        newcomer = RawClient(daemon.run_dir)
        try:
            assert newcomer.hello()["sid"] != survivor.sid
            assert allocates_and_frees(newcomer)
        finally:
            newcomer.close()
        assert allocates_and_frees(survivor)
        assert daemon.process.poll() is None
    finally:
        survivor.close()


def test_soft_limit_is_raised_so_a_flood_below_the_hard_one_is_all_served(
    start_limited: Callable[[int, int], DaemonProcess],
) -> None:
    # Like launchd's 256 soft limit under a higher hard one: the daemon lifts its own.
    daemon = start_limited(LOW_FD_LIMIT, 8 * LOW_FD_LIMIT)
    assert f"open-file limit {8 * LOW_FD_LIMIT}, raised from {LOW_FD_LIMIT}" in daemon.log()
    n_idle = 2 * LOW_FD_LIMIT
    flood = start_flood(daemon.run_dir, n_idle, "raw")
    try:
        # Every idle connection is accepted: more than the old soft limit allowed.
        wait_until(lambda: psutil.Process(daemon.pid).num_fds() >= n_idle, timeout=15)
        assert "new connections" not in daemon.log()
        assert daemon.admin("ping")["pid"] == daemon.pid
    finally:
        end_flood(flood)
