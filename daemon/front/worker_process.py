"""One model's ``vqpool-worker`` as a child process of the front door: started, waited for until
it serves, stopped.

The worker binds port 0 and prints its real address on stdout once it serves; its log (stderr)
goes to ``workers/NAME.log`` in the run directory, whose last line says why a worker that
exited stopped. Its stdin is a pipe only the front door holds (``--exit-on-stdin-eof``): if the
front door dies, even by SIGKILL, its workers stop too, so a restarted front door never finds a
model loaded twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from pathlib import Path

from vqpool.daemon.front.catalog import ModelEntry

STOP_TIMEOUT = 30.0
"""Seconds a worker may take to stop after SIGTERM (it ends its running requests first) before
SIGKILL."""
LOG_TAIL_BYTES = 4096
_SERVING_LINE = re.compile(rb"serving .* on http://([\w.:\[\]-]+)")
_UNSAFE = re.compile(r"[^\w.-]+")
# The worker's log format: "2026-12-02 01:44:30,228 vqpool-worker[20596] ERROR message".
_LOG_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ \S+\[\d+\] [A-Z]+ ")


class WorkerStartError(RuntimeError):
    """The worker exited, or never said it serves, before the deadline; the message is its
    one-line reason."""


def log_path(run_dir: Path, name: str) -> Path:
    """Where the worker of model ``name`` writes its log."""
    return run_dir / "workers" / (_UNSAFE.sub("_", name).strip("_")[:120] + ".log")


def last_log_line(path: Path) -> str:
    """The last non-empty line of a worker's log, without its time and level ("" when there
    is none)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            tail = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return _LOG_PREFIX.sub("", lines[-1]) if lines else ""


class WorkerProcess:
    """A started worker: its process, its address once it serves."""

    def __init__(self, entry: ModelEntry, run_dir: Path, cache_limit: int | None = None) -> None:
        self.entry = entry
        self.run_dir = run_dir
        self.cache_limit = cache_limit
        """Bytes of MLX buffer cache the worker declares as its overhead, charged beside its
        weights (given as ``--mlx-cache-limit`` unless its entry sets it; None: not charged)."""
        self.log_path = log_path(run_dir, entry.name)
        self.process: asyncio.subprocess.Process | None = None
        self.address = ""

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def argv(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "vqpool.worker.serve",
            "--model",
            self.entry.path,
            "--served-model-name",
            self.entry.name,
            "--port",
            "0",
            "--run-dir",
            str(self.run_dir),
            "--exit-on-stdin-eof",
            *self._charged_cache(),
            *self.entry.worker_args,
        ]

    def _charged_cache(self) -> list[str]:
        if self.cache_limit is None:
            return []
        if self.entry.worker_option("--mlx-cache-limit") is not None:
            return ["--charge-mlx-cache"]
        return ["--mlx-cache-limit", str(self.cache_limit), "--charge-mlx-cache"]

    async def start(self, timeout: float) -> None:
        """Start the worker and wait until it serves.

        Raises:
            WorkerStartError: It exited first (its last log line says why) or took longer than
                ``timeout`` seconds (it is stopped).
        """
        self.log_path.parent.mkdir(mode=0o700, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = await asyncio.create_subprocess_exec(
                *self.argv(),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                start_new_session=True,  # signals come from the front door, in its order
            )
        try:
            self.address = await asyncio.wait_for(self._read_address(), timeout)
        except TimeoutError:
            await self.stop()
            raise WorkerStartError(
                f"the worker of {self.entry.name} did not serve within {timeout:g} s "
                f"(log: {self.log_path})"
            ) from None
        except WorkerStartError:
            await self.stop()
            raise

    async def _read_address(self) -> str:
        assert self.process is not None and self.process.stdout is not None
        while True:
            line = await self.process.stdout.readline()
            if not line:  # stdout closed: the worker exited
                status = await self.process.wait()
                raise WorkerStartError(self.exit_reason(status))
            match = _SERVING_LINE.search(line)
            if match:
                return match.group(1).decode()

    def exit_reason(self, status: int) -> str:
        """One line on why the worker exited with ``status``."""
        how = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
        last = last_log_line(self.log_path)
        return f"the worker of {self.entry.name} {how}" + (f": {last}" if last else "")

    async def wait(self) -> int:
        """Its exit status, once it has exited."""
        assert self.process is not None
        return await self.process.wait()

    async def stop(self, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM, wait for the exit (SIGKILL after ``timeout``); the exit status."""
        process = self.process
        if process is None:
            return 0
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), timeout)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        if process.stdin is not None:
            process.stdin.close()
        return process.returncode or 0
