"""Start and stop vqpoold and vqpool-worker processes from Python (the demo, the benchmark, tests).

Both run as real subprocesses of the current interpreter (``python -m vqpool.daemon``,
``python -m vqpool.worker.serve``) with their stdout and stderr in a log file, so a caller that
fails can show what the process said (and a worker's ready line is read from there).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vqpool.shared.admin_client import AdminClient
from vqpool.shared.config import ADMIN_SOCKET_NAME
from vqpool.shared.errors import DaemonUnavailableError

READY_TIMEOUT = 60.0
_SERVING_LINE = re.compile(r"serving (\S+) on (http://[\w.:\[\]-]+)")


def stop_process(process: subprocess.Popen[Any], sig: int, timeout: float) -> int:
    """Send ``sig`` to ``process`` (if it still runs), wait for its exit status, SIGKILL it
    after ``timeout`` seconds."""
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


class ProcessExitedError(RuntimeError):
    """A started process exited while its caller waited for it to be ready.

    Attributes:
        status: Its exit status.
        last_line: The last line it wrote (a vqpool command says why it stopped in one line).
    """

    def __init__(self, what: str, status: int, log: str) -> None:
        super().__init__(f"{what} exited with status {status}:\n{log[-4000:]}")
        self.status = status
        lines = log.strip().splitlines()
        self.last_line = lines[-1] if lines else ""


class _Process:
    """A subprocess whose output goes to ``log_path``."""

    def __init__(self, argv: Sequence[str], log_path: Path) -> None:
        self.argv = list(argv)
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def _spawn(self) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=log)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def log(self) -> str:
        """Everything the process wrote so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def _check_alive(self, what: str) -> None:
        assert self.process is not None
        if self.process.poll() is not None:
            raise ProcessExitedError(what, self.process.returncode, self.log())

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        """Send ``sig``, wait for the exit status (SIGKILL after ``timeout``)."""
        assert self.process is not None
        return stop_process(self.process, sig, timeout)


class DaemonProcess(_Process):
    """``vqpoold --run-dir RUN_DIR ARGS...``."""

    def __init__(self, run_dir: Path, args: Sequence[str] = (), log_path: Path | None = None):
        self.run_dir = run_dir
        super().__init__(
            [sys.executable, "-m", "vqpool.daemon", "--run-dir", str(run_dir), *args],
            log_path or run_dir.parent / "vqpoold.log",
        )

    def start(self, timeout: float = READY_TIMEOUT) -> DaemonProcess:
        """Start and return once the admin socket answers."""
        self._spawn()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive("vqpoold")
            if (self.run_dir / ADMIN_SOCKET_NAME).exists():
                try:
                    with AdminClient(self.run_dir, timeout=0.5) as admin:
                        admin.call("ping")
                    return self
                except DaemonUnavailableError:
                    pass
            time.sleep(0.05)
        raise RuntimeError(f"vqpoold not ready after {timeout}s:\n{self.log()}")


class WorkerProcess(_Process):
    """``vqpool-worker --model MODEL --port 0 ...``; :attr:`url` once started.

    Args:
        model: ``--model``.
        log_path: Where its stdout and stderr go.
        run_dir: ``--run-dir`` (None: the worker's default); ignored with ``no_pool``.
        no_pool: Serve from stock caches (``--no-pool``).
        args: More options (``--max-concurrent``, ``--queue-timeout``, ...).
    """

    def __init__(
        self,
        model: str,
        log_path: Path,
        *,
        run_dir: Path | None = None,
        no_pool: bool = False,
        args: Sequence[str] = (),
    ) -> None:
        argv = [sys.executable, "-m", "vqpool.worker.serve", "--model", model, "--port", "0"]
        if no_pool:
            argv.append("--no-pool")
        elif run_dir is not None:
            argv += ["--run-dir", str(run_dir)]
        super().__init__([*argv, *args], log_path)
        self.model = model
        self.url = ""

    def start(self, wait: bool = True, timeout: float = READY_TIMEOUT) -> WorkerProcess:
        """Start it; with ``wait``, return once it serves (see :meth:`wait_ready`)."""
        self._spawn()
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> WorkerProcess:
        """Return once it logged the address it serves on (for a real model: once loaded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive(f"vqpool-worker {self.model}")
            match = _SERVING_LINE.search(self.log())
            if match:
                self.url = match.group(2)
                return self
            time.sleep(0.05)
        raise RuntimeError(f"vqpool-worker {self.model} not ready after {timeout}s:\n{self.log()}")
