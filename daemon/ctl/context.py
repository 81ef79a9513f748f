"""What every vqpoolctl command gets: the admin connection, output, and session lookup."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from vqpool.daemon.ctl.exits import CtlError, Exit
from vqpool.shared.config import ADMIN_SOCKET_NAME, socket_path
from vqpool.shared.errors import DaemonUnavailableError
from vqpool.shared.front_client import FrontDoorClient
from vqpool.shared.protocol import session_label

if TYPE_CHECKING:
    from vqpool.shared.admin_client import AdminClient


class Ctl:
    """One vqpoolctl invocation: where the daemon is, how to print, and admin calls.

    Args:
        run_dir: The daemon's run directory (already resolved).
        timeout: Seconds to wait for each admin reply.
        as_json: Print machine-readable JSON instead of text.
        out: Where results go (stdout).
        stdin: Where confirmations are read from.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        timeout: float,
        as_json: bool = False,
        out: TextIO = sys.stdout,
        stdin: TextIO = sys.stdin,
    ) -> None:
        self.run_dir = run_dir
        self.timeout = timeout
        self.as_json = as_json
        self.out = out
        self.stdin = stdin
        self._client: AdminClient | None = None

    def call(self, op: str, **args: Any) -> Any:
        """Run admin op ``op`` and return its result.

        Raises:
            CtlError: No daemon on the run directory (NOT_RUNNING).
            VqpoolError, ValueError: The daemon refused the request.
        """
        if self._client is None:
            admin_socket = socket_path(self.run_dir, ADMIN_SOCKET_NAME)
            if not admin_socket.exists():
                raise CtlError(
                    f"vqpoold is not running: no {ADMIN_SOCKET_NAME} in {self.run_dir}; start "
                    f"it with `vqpoold --run-dir {self.run_dir}`",
                    Exit.NOT_RUNNING,
                )
            # Imported here: pyzmq takes ~20 ms to import, which --help and usage errors need
            # not pay.
            from vqpool.shared.admin_client import AdminClient

            self._client = AdminClient(self.run_dir, timeout=self.timeout)
        try:
            return self._client.call(op, **args)
        except DaemonUnavailableError:
            raise CtlError(
                f"vqpoold is not running: {self.run_dir / ADMIN_SOCKET_NAME} did not answer "
                f"within {self.timeout:g}s (a stale socket left by a killed daemon?)",
                Exit.NOT_RUNNING,
            ) from None

    def front_door(self, wait: float = 0.0) -> FrontDoorClient:
        """A client of the control socket of the ``vqpool serve`` on the run directory, whose
        calls may take ``wait`` seconds (a load) beyond the reply timeout."""
        return FrontDoorClient(self.run_dir, timeout=self.timeout + wait)

    def print(self, text: str = "") -> None:
        print(text, file=self.out)

    def print_json(self, value: Any) -> None:
        print(json.dumps(value, indent=2, sort_keys=True), file=self.out)

    def find_session(self, text: str) -> dict[str, Any]:
        """The session (as the ``sessions`` op shows it) whose hex id is or starts with ``text``.

        Raises:
            CtlError: No such session (REFUSED), or ``text`` is not hex or names several
                (BAD_ARGUMENTS).
        """
        wanted = text.lower().removeprefix("0x")
        try:
            int(wanted, 16)
        except ValueError:
            raise CtlError(
                f"--session {text!r} is not a session id (hex, as `vqpoolctl sessions` shows it)",
                Exit.BAD_ARGUMENTS,
            ) from None
        sessions: list[dict[str, Any]] = self.call("sessions")
        exact = [s for s in sessions if session_label(s["sid"]) == wanted]
        matches = exact or [s for s in sessions if session_label(s["sid"]).startswith(wanted)]
        if not matches:
            raise CtlError(f"no session {text} (see `vqpoolctl sessions`)", Exit.REFUSED)
        if len(matches) > 1:
            labels = ", ".join(session_label(s["sid"]) for s in matches)
            raise CtlError(
                f"--session {text} matches several sessions: {labels}", Exit.BAD_ARGUMENTS
            )
        return matches[0]

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
