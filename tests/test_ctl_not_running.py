"""vqpoolctl without a daemon: one line naming the run directory, the documented exit code, no
traceback; likewise for bad arguments."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from ctl_harness import run_ctl, run_ctl_each
from daemon_harness import remove_tree, short_tmpdir
from vqpool.worker.testing.launch import DaemonProcess

COMMANDS = [
    ["status"],
    ["sessions"],
    ["owners"],
    ["owners", "--session", "abc"],
    ["shrink", "--stream", "k", "--target-free", "0"],
    ["evict", "--session", "abc", "--yes"],
    ["history"],
    ["metrics"],
    ["watch"],
    ["budget"],
    ["budget", "6GiB"],
    ["model", "list"],
    ["model", "set", "x", "--weight", "2"],
    ["fit", "--model", "x", "--context", "16"],
]


@pytest.fixture(scope="module")
def no_daemon_runs() -> Iterator[tuple[Path, list[subprocess.CompletedProcess[str]]]]:
    """Every command of COMMANDS on a run directory with no daemon, run four at a time."""
    base = short_tmpdir()
    run_dir = base / "run"
    yield run_dir, run_ctl_each(run_dir, COMMANDS)
    remove_tree(base)


@pytest.mark.parametrize("index", range(len(COMMANDS)), ids=[c[0] for c in COMMANDS])
def test_no_daemon(
    no_daemon_runs: tuple[Path, list[subprocess.CompletedProcess[str]]], index: int
) -> None:
    run_dir, results = no_daemon_runs
    result = results[index]
    assert result.returncode == 3
    assert result.stdout == ""
    # One line naming the command to start and the run directory looked in.
    assert result.stderr == (
        f"vqpoolctl: vqpoold is not running: no admin.sock in {run_dir}; start it with "
        f"`vqpoold --run-dir {run_dir}`\n"
    )


def test_stale_socket_of_a_killed_daemon(
    start_daemon: Callable[..., DaemonProcess], run_dir: Path
) -> None:
    daemon = start_daemon(run_dir=run_dir)
    assert daemon.stop(signal.SIGKILL) == -signal.SIGKILL
    assert (run_dir / "admin.sock").exists()
    result = run_ctl(run_dir, "--timeout", "0.5", "status")
    assert result.returncode == 3
    assert result.stderr == (
        f"vqpoolctl: vqpoold is not running: {run_dir / 'admin.sock'} did not answer within "
        "0.5s (a stale socket left by a killed daemon?)\n"
    )


def test_bad_arguments_exit_2(run_dir: Path) -> None:
    commands = [
        ["frobnicate"],
        [],
        ["status", "--timeout", "0"],
        ["history", "--limit", "0"],
        ["budget", "40x"],
        ["budget", "0%"],
        ["model"],
        ["model", "set", "x"],
        ["model", "set", "x", "--reserve", "-1GiB"],
        ["fit", "--model", "x", "--context", "0"],
        ["fit", "--context", "16"],
    ]
    for args, result in zip(commands, run_ctl_each(run_dir, commands), strict=True):
        assert result.returncode == 2, (args, result.stderr)
        assert "Traceback" not in result.stderr
    too_long = run_ctl(Path("/tmp") / ("x" * 120), "status")
    assert too_long.returncode == 2
    assert "Unix sockets allow at most" in too_long.stderr


def test_run_dir_from_the_environment(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ctl_harness import VQPOOLCTL

    monkeypatch.setenv("VQPOOL_RUN_DIR", str(run_dir))
    result = subprocess.run([VQPOOLCTL, "status"], capture_output=True, text=True, timeout=20)
    assert result.returncode == 3 and str(run_dir) in result.stderr


def test_vqpoolctl_imports_neither_mlx_nor_the_worker_package() -> None:
    import sys

    code = (
        "import sys, vqpool.daemon.ctl.cli, vqpool.daemon.ctl.plot, vqpool.daemon.ctl.terminal; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'mlx' "
        "or m.startswith('vqpool.worker')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
