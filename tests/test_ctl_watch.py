"""vqpoolctl watch in a pseudo-terminal: it redraws the live pool, follows changes, and quits
on q with the terminal restored."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import termios
import time
from collections.abc import Callable, Iterator

import pytest
from ctl_harness import VQPOOLCTL, LivePool
from daemon_harness import AgentProcess, remove_tree, short_tmpdir, wait_until
from vqpool.worker.testing.launch import DaemonProcess

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture
def pool() -> Iterator[LivePool]:
    live = LivePool.start("--n-blocks", "256", "--lease", "5")
    yield live
    live.stop()


def _own_terminal() -> None:
    # In the child: a new session whose controlling terminal is the pty (stdin), so that
    # Ctrl-C typed into it reaches the child as SIGINT, as in a real terminal.
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    # A shell gives its foreground job the default SIGINT; a suite started in the background
    # (`pytest &`) would pass on its ignored one, and Python keeps an ignored SIGINT ignored.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class PtyProcess:
    """A process whose stdin, stdout and stderr are a pseudo-terminal (120x40 by default)."""

    def __init__(self, *args: str, columns: int = 120) -> None:
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
        self.process = subprocess.Popen(
            args, stdin=slave, stdout=slave, stderr=slave, preexec_fn=_own_terminal
        )
        os.close(slave)
        self.output = b""

    def read_until(self, predicate: Callable[[str], bool], timeout: float = 10.0) -> str:
        """Read output until ``predicate(text)`` holds (text without escape sequences)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self.text()):
                return self.text()
            ready, _, _ = select.select([self.master], [], [], 0.1)
            if ready:
                try:
                    self.output += os.read(self.master, 65536)
                except OSError:  # the child closed the terminal
                    break
        raise AssertionError(f"not seen within {timeout}s; output so far:\n{self.text()}")

    def wait(self, timeout: float = 5.0) -> int:
        """The exit status, reading output meanwhile (a full pty would block the child)."""
        deadline = time.monotonic() + timeout
        while self.process.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"still running after {timeout}s:\n{self.text()[-2000:]}")
            ready, _, _ = select.select([self.master], [], [], 0.05)
            if ready:
                with contextlib.suppress(OSError):  # the child closed the terminal
                    self.output += os.read(self.master, 65536)
        # What the child wrote just before exiting may still be in the pty: drain it.
        while select.select([self.master], [], [], 0.1)[0]:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # EIO: no process has the terminal open any more
                break
            if not data:
                break
            self.output += data
        return self.process.returncode

    def text(self) -> str:
        return ANSI.sub("", self.output.decode(errors="replace"))

    def last_frame(self) -> list[str]:
        """The lines of the last complete frame drawn (each frame starts at the cursor's home)."""
        frames = self.output.decode(errors="replace").split("\x1b[H")
        return [ANSI.sub("", line).rstrip("\r") for line in frames[-2].split("\n")]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        os.close(self.master)


def test_watch_redraws_follows_the_pool_and_quits_on_q(pool: LivePool) -> None:
    term = PtyProcess(VQPOOLCTL, "--run-dir", str(pool.run_dir), "watch", "--interval", "0.2")
    try:
        # The last line of a frame: once it is in, the whole first frame is.
        beta_v = re.compile(r"beta\s+v\s+\[[^\]]+\] 7 blocks ")
        first = term.read_until(lambda t: beta_v.search(t) is not None)
        assert f"vqpoold pid {pool.daemon.pid}" in first
        assert re.search(r"^k \[[^\]]+\] 11/128 in use, 117 free", first, re.M)
        assert "10/128 in use, 118 free" in first
        # Bytes: K and V together, on the model's first line (4 + 3 blocks of 4 KiB).
        assert re.search(r"alpha\s+k\s+\[[^\]]+\] 4 blocks, held 28\.0 KiB", first)
        bars = re.search(r"^k \[([^\]]+)\]", first, re.M)
        assert bars is not None and len(bars.group(1)) > 60  # the bar takes the width left
        assert all(len(line) <= 120 for line in term.last_frame())

        # A change in the pool shows up on a later refresh, with a non-zero allocation rate.
        pool.alpha.call("allocate", "k", 160, "a3")
        alpha_k = re.compile(r"alpha\s+k\s+\[[^\]]+\] 14 blocks, held 68\.0 KiB")
        later = term.read_until(lambda t: alpha_k.search(t) is not None)
        assert "21/128 in use, 107 free" in later
        assert re.search(r"allocations \d+\.\d blocks/s", later)
        frames = term.read_until(lambda t: t.count("vqpoold pid") >= later.count("vqpoold pid") + 2)
        assert frames.count("vqpoold pid") >= 3  # redrawn every 0.2 s

        os.write(term.master, b"q")
        assert term.wait() == 0
        raw = term.output
        assert raw.rfind(b"\x1b[?1049l") > raw.rfind(b"vqpoold pid")  # normal screen restored
    finally:
        term.close()


def test_watch_quits_on_ctrl_c(pool: LivePool) -> None:
    term = PtyProcess(VQPOOLCTL, "--run-dir", str(pool.run_dir), "watch", "--interval", "0.2")
    try:
        term.read_until(lambda t: "beta" in t)
        os.write(term.master, b"\x03")  # the terminal turns it into SIGINT
        assert term.wait() == 0
        assert b"Traceback" not in term.output
    finally:
        term.close()


LLAMA_3B = "mlx-community/Llama-3.2-3B-Instruct-4bit"
LLAMA_1B = "mlx-community/Llama-3.2-1B-Instruct-4bit"


@pytest.fixture
def similar_models() -> Iterator[DaemonProcess]:
    """A daemon with two workers whose model names differ in one character, both loaded."""
    base = short_tmpdir()
    daemon = DaemonProcess(base / "run", "--n-blocks", "256", "--lease", "5").start()
    workers = [AgentProcess(daemon.run_dir, name) for name in (LLAMA_3B, LLAMA_1B)]
    try:
        workers[0].call("allocate", "k", 100, "r1")
        workers[0].call("report_load", 2, 3)
        workers[1].call("allocate", "v", 40, "r2")
        workers[1].call("report_load", 1, 0)
        wait_until(
            lambda: all(s["running"] is not None for s in daemon.admin("sessions")), timeout=5
        )
        yield daemon
    finally:
        for worker in workers:
            worker.stop()
        daemon.stop()
        remove_tree(base)


@pytest.mark.parametrize("columns", [80, 60])
def test_watch_fits_a_narrow_terminal_and_tells_similar_models_apart(
    similar_models: DaemonProcess, columns: int
) -> None:
    run_dir = str(similar_models.run_dir)
    term = PtyProcess(
        VQPOOLCTL, "--run-dir", run_dir, "watch", "--interval", "0.2", columns=columns
    )
    try:
        term.read_until(lambda t: t.count("vqpoold pid") >= 2)
        frame = term.last_frame()
        assert all(len(line) <= columns for line in frame), "\n".join(frame)
        text = "\n".join(frame)
        three = [line for line in frame if "3B" in line]
        one = [line for line in frame if "1B" in line]
        assert three and one, text
        # Running on the k line, queued on the v line of each model.
        assert re.search(r" 7 blocks, held 28\.0 KiB +running 2$", three[0]), text
        assert re.search(r" 0 blocks +queued 3$", three[1]), text
        assert re.search(r" 0 blocks, held 12\.0 KiB +running 1$", one[0]), text
        assert re.search(r" 3 blocks +queued 0$", one[1]), text
        os.write(term.master, b"q")
        assert term.wait() == 0
    finally:
        term.close()


def test_watch_piped_prints_plain_frames(similar_models: DaemonProcess) -> None:
    done = subprocess.run(
        [
            VQPOOLCTL,
            "--run-dir",
            str(similar_models.run_dir),
            "watch",
            "--interval=0.1",
            "--count=3",
        ],
        capture_output=True,
        text=True,
        timeout=20,
        env={**os.environ, "COLUMNS": "90"},
    )
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout
    frames = done.stdout.split("\n\n\n")
    assert len(frames) == 3 and all(f.startswith("vqpoold pid") for f in frames), done.stdout
    assert all(len(line) <= 90 for line in done.stdout.splitlines())
    assert "running 2" in frames[-1] and "Llama-3.2-1B-Instruct-4bit" in frames[-1]
