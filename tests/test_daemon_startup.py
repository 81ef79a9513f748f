"""vqpoold start-up safety and shutdown: run directory checks, the lock, signals, settings."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from daemon_harness import RawClient, remove_tree, short_tmpdir
from vqpool.daemon.core.claims import ROLL_FILE_NAME
from vqpool.shared.config import ADMIN_SOCKET_NAME, LOCK_FILE_NAME, WORKER_SOCKET_NAME
from vqpool.worker.testing.launch import DaemonProcess

StartDaemon = Callable[..., DaemonProcess]


def run_vqpoold(*args: str, timeout: float = 10.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vqpool.daemon", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_start_line_says_where_and_what(daemon: DaemonProcess) -> None:
    log = daemon.log()
    assert f"ipc://{daemon.run_dir / WORKER_SOCKET_NAME}" in log
    assert f"ipc://{daemon.run_dir / ADMIN_SOCKET_NAME}" in log
    assert "256 blocks x 16 tokens" in log
    assert "streams k+v (128 each)" in log


def test_run_dir_is_created_private(daemon: DaemonProcess) -> None:
    assert os.stat(daemon.run_dir).st_mode & 0o777 == 0o700
    assert os.stat(daemon.run_dir / WORKER_SOCKET_NAME).st_mode & 0o777 == 0o600


def test_second_daemon_is_refused_quickly_and_first_keeps_serving(daemon: DaemonProcess) -> None:
    started = time.monotonic()
    second = run_vqpoold("--run-dir", str(daemon.run_dir))
    elapsed = time.monotonic() - started
    assert second.returncode == 1
    assert elapsed < 1.0 + 0.5  # interpreter start-up included
    assert f"pid {daemon.pid}" in second.stderr
    assert "already serving" in second.stderr
    assert daemon.admin("ping")["pid"] == daemon.pid
    client = RawClient(daemon.run_dir)
    try:
        client.hello()
        assert client.call("allocate", {"stream": "k", "n_tokens": 16, "owner": 1})["ok"]
    finally:
        client.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly_within_a_second(daemon: DaemonProcess, sig: int) -> None:
    client = RawClient(daemon.run_dir)
    client.hello()
    # A request sent just before the signal is still answered.
    client.send(client.encode("allocate", {"stream": "k", "n_tokens": 16, "owner": "x"}))
    assert client.recv()["ok"]
    started = time.monotonic()
    status = daemon.stop(sig)
    assert time.monotonic() - started < 1.0
    client.close()
    assert status == 0, daemon.log()
    assert not (daemon.run_dir / WORKER_SOCKET_NAME).exists()
    assert not (daemon.run_dir / ADMIN_SOCKET_NAME).exists()
    assert f"stopped on {signal.Signals(sig).name}" in daemon.log()
    # What docs/protocol.md says a stop leaves: the lock and the roll, both private.
    left = {path.name: stat.S_IMODE(path.stat().st_mode) for path in daemon.run_dir.iterdir()}
    assert left == {LOCK_FILE_NAME: 0o600, ROLL_FILE_NAME: 0o600}, left


def test_stale_socket_of_killed_daemon_is_replaced(start_daemon: StartDaemon) -> None:
    first = start_daemon("--n-blocks", "64")
    first.stop(signal.SIGKILL)
    assert (first.run_dir / WORKER_SOCKET_NAME).exists()  # left behind by the crash
    second = start_daemon("--n-blocks", "64", run_dir=first.run_dir)
    assert second.admin("ping")["pid"] == second.pid


def test_group_accessible_run_dir_is_refused() -> None:
    base = short_tmpdir()
    try:
        run_dir = base / "run"
        run_dir.mkdir(mode=0o755)
        os.chmod(run_dir, 0o755)
        result = run_vqpoold("--run-dir", str(run_dir))
        assert result.returncode == 3
        assert "mode 0755" in result.stderr and "chmod 700" in result.stderr
        assert not (run_dir / LOCK_FILE_NAME).exists()
    finally:
        remove_tree(base)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a directory of another user")
def test_run_dir_of_another_user_is_refused() -> None:
    base = short_tmpdir()
    try:
        run_dir = base / "run"
        run_dir.mkdir(mode=0o700)
        os.chown(run_dir, 65534, 65534)
        result = run_vqpoold("--run-dir", str(run_dir))
        assert result.returncode == 3
        assert "belongs to uid 65534" in result.stderr
    finally:
        remove_tree(base)


def test_too_long_socket_path_is_refused() -> None:
    base = short_tmpdir()
    try:
        run_dir = base / ("d" * 120)
        result = run_vqpoold("--run-dir", str(run_dir))
        assert result.returncode == 3
        assert "Unix sockets allow at most" in result.stderr
    finally:
        remove_tree(base)


def test_toml_config_with_command_line_override(start_daemon: StartDaemon, tmp_path: Path) -> None:
    config = tmp_path / "vqpoold.toml"
    config.write_text("n-blocks = 100\nblock_size = 8\nshared_kv = true\nlease = 3.0\n")
    daemon = start_daemon("--config", str(config), "--n-blocks", "50")
    stats = daemon.admin("stats")
    assert stats["config"]["n_blocks"] == 50
    assert stats["config"]["block_size"] == 8
    assert stats["config"]["separate_kv"] is False
    assert stats["lease_s"] == 3.0
    assert stats["streams"] == {"kv": {"free": 50, "total": 50}}


def test_bad_toml_setting_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "vqpoold.toml"
    config.write_text("n_blocks = 'many'\n")
    result = run_vqpoold("--config", str(config), "--run-dir", "/tmp/never-used")
    assert result.returncode == 2
    assert "n_blocks must be int" in result.stderr


def test_run_dir_from_environment(run_dir: Path) -> None:
    env = {**os.environ, "VQPOOL_RUN_DIR": str(run_dir)}
    process = subprocess.Popen(
        [sys.executable, "-m", "vqpool.daemon", "--n-blocks", "32"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stderr is not None
        line = process.stderr.readline()
        assert f"ipc://{run_dir / WORKER_SOCKET_NAME}" in line
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(5) == 0


def refused_in_one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one stderr line of a vqpoold that refused to start (fails on a traceback)."""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.parametrize("name", [WORKER_SOCKET_NAME, ADMIN_SOCKET_NAME])
def test_directory_where_a_socket_goes_is_refused_in_one_line(run_dir: Path, name: str) -> None:
    run_dir.mkdir(mode=0o700)
    (run_dir / name).mkdir()
    result = run_vqpoold("--run-dir", str(run_dir))
    assert result.returncode == 3
    line = refused_in_one_line(result)
    assert str(run_dir / name) in line and "not a socket" in line
    assert (run_dir / name).is_dir()  # nothing of the user's is deleted


def test_lock_file_symlink_is_not_followed(run_dir: Path) -> None:
    run_dir.mkdir(mode=0o700)
    target = run_dir.parent / "precious.txt"
    target.write_text("keep me\n")
    (run_dir / LOCK_FILE_NAME).symlink_to(target)
    result = run_vqpoold("--run-dir", str(run_dir))
    assert result.returncode == 4
    line = refused_in_one_line(result)
    assert str(run_dir / LOCK_FILE_NAME) in line and "symlink" in line
    assert target.read_text() == "keep me\n"
    assert not (run_dir / WORKER_SOCKET_NAME).exists()


@pytest.mark.parametrize("kind", ["directory", "fifo", "hard link"])
def test_lock_file_that_is_not_a_plain_file_is_refused(run_dir: Path, kind: str) -> None:
    run_dir.mkdir(mode=0o700)
    lock = run_dir / LOCK_FILE_NAME
    other = run_dir.parent / "other.txt"
    if kind == "directory":
        lock.mkdir()
    elif kind == "fifo":
        os.mkfifo(lock)
    else:
        other.write_text("keep me\n")
        os.link(other, lock)
    result = run_vqpoold("--run-dir", str(run_dir))
    assert result.returncode == 4
    line = refused_in_one_line(result)
    assert str(lock) in line
    if kind == "hard link":
        assert other.read_text() == "keep me\n"


def test_each_startup_refusal_has_its_own_status(daemon: DaemonProcess) -> None:
    already_running = run_vqpoold("--run-dir", str(daemon.run_dir))
    bad_setting = run_vqpoold("--run-dir", "/tmp/never-used", "--lease", "0")
    base = short_tmpdir()
    try:
        not_a_dir = base / "file"
        not_a_dir.write_text("")
        bad_run_dir = run_vqpoold("--run-dir", str(not_a_dir))
    finally:
        remove_tree(base)
    statuses = {
        "already running": already_running.returncode,
        "bad settings": bad_setting.returncode,
        "bad run dir": bad_run_dir.returncode,
    }
    assert statuses == {"already running": 1, "bad settings": 2, "bad run dir": 3}
    for result in (already_running, bad_setting, bad_run_dir):
        refused_in_one_line(result)


def test_help_documents_the_exit_statuses() -> None:
    result = run_vqpoold("--help")
    assert result.returncode == 0
    assert "exit status" in result.stdout.lower()
    for status, words in [(1, "already"), (2, "settings"), (3, "run directory"), (4, "lock")]:
        assert any(
            line.strip().startswith(str(status)) and words in line.lower()
            for line in result.stdout.splitlines()
        ), result.stdout


def test_socket_hidden_by_a_killed_daemons_guard_is_cleared(start_daemon: StartDaemon) -> None:
    first = start_daemon("--n-blocks", "64")
    first.stop(signal.SIGKILL)
    # As if it died while refusing connections: its socket file renamed to the hidden name.
    hidden = first.run_dir / f".{WORKER_SOCKET_NAME}.full"
    (first.run_dir / WORKER_SOCKET_NAME).rename(hidden)
    second = start_daemon("--n-blocks", "64", run_dir=first.run_dir)
    assert not hidden.exists()
    client = RawClient(second.run_dir)
    try:
        assert client.hello()["sid"]
    finally:
        client.close()


def test_non_socket_at_the_hidden_socket_name_is_refused(run_dir: Path) -> None:
    run_dir.mkdir(mode=0o700)
    hidden = run_dir / f".{WORKER_SOCKET_NAME}.full"
    hidden.mkdir()
    result = run_vqpoold("--run-dir", str(run_dir))
    assert result.returncode == 3
    assert str(hidden) in refused_in_one_line(result)
    assert hidden.is_dir()
