"""The vqpoold that ``vqpool serve`` works with: the one already running on the run directory, or
one it starts as its child (and stops when it stops).

A started daemon gets the same settings file, so the budget and the models' reserves, limits
and weights come from the one file that also says what to serve. Its log is the front door's
stderr, prefixed by its own name and pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from pathlib import Path

from vqpool.shared.admin_client import AdminClient
from vqpool.shared.config import ADMIN_SOCKET_NAME, socket_path
from vqpool.shared.errors import VqpoolError

DAEMON_READY_TIMEOUT = 15.0
DAEMON_STOP_TIMEOUT = 10.0


class DaemonStartError(RuntimeError):
    """No daemon answers and the one started exited or did not answer in time."""


def daemon_answers(run_dir: Path, timeout: float = 1.0) -> bool:
    """Whether a vqpoold answers ``ping`` on ``run_dir``."""
    if not socket_path(run_dir, ADMIN_SOCKET_NAME).exists():
        return False
    try:
        with AdminClient(run_dir, timeout=timeout) as admin:
            admin.call("ping")
    except VqpoolError:
        return False
    return True


class DaemonChild:
    """The daemon the front door started, if it started one."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.process: asyncio.subprocess.Process | None = None

    async def ensure(self, config: str | None, budget: str | None) -> bool:
        """Use the running daemon, or start one; whether it was started here.

        Raises:
            DaemonStartError: The started daemon exited (its status; its log said why) or did
                not answer within ``DAEMON_READY_TIMEOUT``.
        """
        if await asyncio.to_thread(daemon_answers, self.run_dir):
            return False
        argv = [sys.executable, "-m", "vqpool.daemon", "--run-dir", str(self.run_dir)]
        if config:
            argv += ["--config", config]
        if budget:
            argv += ["--budget", budget]
        # Its own session: a Ctrl-C in the terminal reaches the front door, which stops the
        # workers first and the daemon last.
        self.process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + DAEMON_READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.returncode is not None:
                raise DaemonStartError(
                    f"vqpoold exited with status {self.process.returncode} (its log above says why)"
                )
            if await asyncio.to_thread(daemon_answers, self.run_dir, 0.5):
                return True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.process.wait(), 0.1)
        await self.stop()
        raise DaemonStartError(f"vqpoold did not answer within {DAEMON_READY_TIMEOUT:g} s")

    async def budget(self) -> int | None:
        """The daemon's budget in bytes now (None: it has none).

        Raises:
            VqpoolError: It does not answer.
        """

        def ask() -> int | None:
            with AdminClient(self.run_dir) as admin:
                budget: int | None = admin.call("budget")["budget"]
                return budget

        return await asyncio.to_thread(ask)

    async def stop(self) -> None:
        """SIGTERM the started daemon and wait for it (SIGKILL after a deadline)."""
        process = self.process
        if process is None or process.returncode is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), DAEMON_STOP_TIMEOUT)
        except TimeoutError:
            process.kill()
            await process.wait()
