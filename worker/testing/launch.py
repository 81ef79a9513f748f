"""Start and stop vqpoold, vqpool-worker and vqpool serve processes from Python (the demo, the
benchmarks, tests).

Each runs as a real subprocess of the current interpreter (``python -m vqpool.daemon``,
``python -m vqpool.worker.serve``, ``python -m vqpool.daemon.front serve``) with its stdout and
stderr in a log file, so a caller that fails can show what the process said (and a worker's or
front door's ready line is read from there). A :class:`DaemonProcess` also calls admin ops on
its daemon, and a :class:`ServeProcess` reads its models' rows on its control socket, for the
callers that check their state.
"""

from __future__ import annotations

import re
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil
from vqpool.shared.admin_client import AdminClient
from vqpool.shared.config import ADMIN_SOCKET_NAME, WORKER_SOCKET_NAME
from vqpool.shared.errors import DaemonUnavailableError
from vqpool.shared.front_client import FrontDoorClient

WORKER_READY_TIMEOUT = 60.0
"""Seconds a worker may take to serve (it loads its model first)."""

DAEMON_READY_TIMEOUT = 15.0
"""Seconds a daemon may take to answer (it starts in well under one: more means stuck)."""

DAEMON_STOP_TIMEOUT = 5.0
"""Seconds a stopped daemon may take to exit before SIGKILL (it takes well under one)."""
_SERVING_LINE = re.compile(r"serving (\S+) on (http://[\w.:\[\]-]+)")

SERVE_READY_TIMEOUT = 60.0
"""Seconds ``vqpool serve`` may take to serve (it starts vqpoold; models load on demand)."""

SERVE_STOP_TIMEOUT = 60.0
"""Seconds a stopped ``vqpool serve`` may take to exit: it stops its workers first, each ending
its running requests."""
_FRONT_READY_LINE = re.compile(r"vqpool serve: serving .* on (http://[\w.:\[\]-]+)")


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

    def _spawn(
        self, preexec_fn: Callable[[], None] | None = None, stdin_pipe: bool = False
    ) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.argv,
                stdin=subprocess.PIPE if stdin_pipe else None,
                stdout=log,
                stderr=log,
                preexec_fn=preexec_fn,
            )

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
    """``vqpoold --run-dir RUN_DIR ARGS...``, its admin ops, and its stop (SIGTERM, or SIGKILL
    for crash tests).

    Args:
        run_dir: ``--run-dir``.
        args: More vqpoold options.
        log_path: Where its stdout and stderr go (None: ``RUN_DIR.vqpoold.log`` beside the run
            directory, so daemons on sibling run directories keep separate logs).
        fd_limit: The daemon's (soft, hard) RLIMIT_NOFILE, when given.
    """

    def __init__(
        self,
        run_dir: Path,
        *args: str,
        log_path: Path | None = None,
        fd_limit: tuple[int, int] | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.args = args
        self.fd_limit = fd_limit
        super().__init__(
            [sys.executable, "-m", "vqpool.daemon", "--run-dir", str(run_dir), *args],
            log_path or run_dir.parent / f"{run_dir.name}.vqpoold.log",
        )
        self._admin: AdminClient | None = None

    def start(self, wait: bool = True, timeout: float = DAEMON_READY_TIMEOUT) -> DaemonProcess:
        """Start the daemon; with ``wait``, return once its admin socket answers."""
        self._spawn(None if self.fd_limit is None else self._limit_fds)
        if wait:
            self.wait_ready(timeout)
        return self

    def _limit_fds(self) -> None:
        assert self.fd_limit is not None
        resource.setrlimit(resource.RLIMIT_NOFILE, self.fd_limit)

    def wait_ready(self, timeout: float = DAEMON_READY_TIMEOUT) -> None:
        """Block until both sockets exist and the admin socket answers ping.

        Raises:
            ProcessExitedError: The daemon exited meanwhile (its log is in the message).
            RuntimeError: Not ready after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive("vqpoold")
            if (self.run_dir / ADMIN_SOCKET_NAME).exists() and (
                self.run_dir / WORKER_SOCKET_NAME
            ).exists():
                try:
                    with AdminClient(self.run_dir, timeout=0.5) as admin:
                        admin.call("ping")
                    return
                except DaemonUnavailableError:
                    pass
            time.sleep(0.02)
        raise RuntimeError(f"vqpoold not ready after {timeout}s:\n{self.log()}")

    def admin(self, op: str, **args: Any) -> Any:
        """Run an admin op and return its result."""
        if self._admin is None:
            self._admin = AdminClient(self.run_dir, timeout=5.0)
        return self._admin.call(op, **args)

    def audit(self) -> dict[str, Any]:
        """Run the admin audit; AssertionError listing the problems if it found any."""
        report: dict[str, Any] = self.admin("audit")
        if not report["ok"]:
            raise AssertionError(report["problems"])
        return report

    def rss(self) -> int:
        """Resident memory of the daemon process, in bytes."""
        return int(psutil.Process(self.pid).memory_info().rss)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = DAEMON_STOP_TIMEOUT) -> int:
        """Close the admin connection, send ``sig`` and wait for the exit status (SIGKILL
        after ``timeout``)."""
        if self._admin is not None:
            self._admin.close()
            self._admin = None
        return super().stop(sig, timeout)

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class WorkerProcess(_Process):
    """``vqpool-worker --model MODEL --port 0 ...``; :attr:`url` once started.

    Args:
        model: ``--model``.
        log_path: Where its stdout and stderr go.
        run_dir: ``--run-dir`` (None: the worker's default); ignored with ``no_pool``.
        no_pool: Serve from stock caches (``--no-pool``).
        args: More options (``--max-concurrent``, ``--queue-timeout``, ...).
        stdin_pipe: Its stdin is a pipe whose write end only this object holds (as a
            supervisor's is; :meth:`close_stdin` closes it), not this process's stdin.
    """

    def __init__(
        self,
        model: str,
        log_path: Path,
        *,
        run_dir: Path | None = None,
        no_pool: bool = False,
        args: Sequence[str] = (),
        stdin_pipe: bool = False,
    ) -> None:
        argv = [sys.executable, "-m", "vqpool.worker.serve", "--model", model, "--port", "0"]
        if no_pool:
            argv.append("--no-pool")
        elif run_dir is not None:
            argv += ["--run-dir", str(run_dir)]
        super().__init__([*argv, *args], log_path)
        self.model = model
        self.stdin_pipe = stdin_pipe
        self.url = ""

    def start(self, wait: bool = True, timeout: float = WORKER_READY_TIMEOUT) -> WorkerProcess:
        """Start it; with ``wait``, return once it serves (see :meth:`wait_ready`)."""
        self._spawn(stdin_pipe=self.stdin_pipe)
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = WORKER_READY_TIMEOUT) -> WorkerProcess:
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

    def close_stdin(self) -> None:
        """Close the write end of its stdin pipe (as a supervisor's death does)."""
        assert self.process is not None and self.process.stdin is not None, "no stdin pipe"
        self.process.stdin.close()


class ServeProcess(_Process):
    """``vqpool serve --run-dir RUN_DIR --port 0 ...`` (the front door); :attr:`url` once it
    serves.

    Args:
        run_dir: Its ``--run-dir`` (it starts vqpoold there unless one runs; a short path: its
            sockets live there).
        log_path: Where its stdout and stderr go (the vqpoold it starts logs there too).
        args: More options (``--model``, ``--config``, ``--max-loaded``, ...).
    """

    def __init__(self, run_dir: Path, log_path: Path, args: Sequence[str] = ()) -> None:
        argv = [sys.executable, "-m", "vqpool.daemon.front", "serve", "--run-dir", str(run_dir)]
        super().__init__([*argv, "--port", "0", *args], log_path)
        self.run_dir = run_dir
        self.url = ""

    def start(self, timeout: float = SERVE_READY_TIMEOUT) -> ServeProcess:
        """Start it and return once it serves (its ready line, read every 10 ms).

        Raises:
            ProcessExitedError: It exited meanwhile (its last line says why).
            RuntimeError: Not serving after ``timeout`` seconds.
        """
        self._spawn()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive("vqpool serve")
            match = _FRONT_READY_LINE.search(self.log())
            if match:
                self.url = match.group(1)
                return self
            time.sleep(0.01)
        raise RuntimeError(f"vqpool serve not serving after {timeout}s:\n{self.log()}")

    def control(self, timeout: float = 600.0) -> FrontDoorClient:
        """A client of its control socket (``timeout``: the longest a load may be waited for)."""
        return FrontDoorClient(self.run_dir, timeout=timeout)

    def rows(self) -> dict[str, dict[str, Any]]:
        """Each model's row (state, pid, url, loads, ...), by name."""
        return {row["name"]: row for row in self.control().models()["models"]}

    def stop(self, sig: int = signal.SIGTERM, timeout: float = SERVE_STOP_TIMEOUT) -> int:
        """Send ``sig`` (SIGTERM: it stops its workers and the vqpoold it started, then exits
        0); its exit status."""
        return super().stop(sig, timeout)
