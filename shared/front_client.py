"""Ask a running ``vqpool serve`` about its models, on its control socket in the run directory
(``front.sock``, owner only): what ``vqpoolctl ps``, ``load``, ``unload`` and ``cache drop
--disk`` use.

Plain HTTP over the Unix socket, standard library only.
"""

from __future__ import annotations

import http.client
import json
import socket
from pathlib import Path
from typing import Any

from vqpool.shared.config import FRONT_SOCKET_NAME, socket_path


class FrontDoorNotRunning(Exception):
    """No ``vqpool serve`` answers on the run directory."""


class FrontDoorRefused(Exception):
    """The front door answered with an error (its message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_file = str(path)

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_file)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class FrontDoorClient:
    """Calls on the control socket of the front door serving ``run_dir``.

    Args:
        run_dir: The run directory (already resolved).
        timeout: Seconds each call may take (a load waits for the model; give it room).
    """

    def __init__(self, run_dir: Path, timeout: float = 10.0) -> None:
        self.path = socket_path(run_dir, FRONT_SOCKET_NAME)
        self.timeout = timeout

    def _call(self, method: str, route: str, body: dict[str, Any] | None = None) -> Any:
        if not self.path.exists():
            raise FrontDoorNotRunning(f"vqpool serve is not running (no {self.path})")
        conn = _UnixConnection(self.path, self.timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if data is not None else {}
            try:
                conn.request(method, route, body=data, headers=headers)
                response = conn.getresponse()
                raw = response.read()
            except (ConnectionRefusedError, FileNotFoundError):
                raise FrontDoorNotRunning(
                    f"vqpool serve is not running (nothing answers on {self.path})"
                ) from None
            except TimeoutError:
                raise FrontDoorNotRunning(
                    f"vqpool serve did not answer within {self.timeout:g} s"
                ) from None
        finally:
            conn.close()
        try:
            reply = json.loads(raw)
        except ValueError:
            raise FrontDoorRefused(response.status, raw[:200].decode(errors="replace")) from None
        if response.status != 200:
            error = reply.get("error", {}) if isinstance(reply, dict) else {}
            raise FrontDoorRefused(response.status, str(error.get("message", reply)))
        return reply

    def models(self) -> dict[str, Any]:
        """The front door's pid, URL, ``max_loaded`` and one row per model (``models``)."""
        result: dict[str, Any] = self._call("GET", "/models")
        return result

    def load(self, model: str, wait: float) -> dict[str, Any]:
        """Load ``model`` (waiting at most ``wait`` seconds); its row."""
        result: dict[str, Any] = self._call("POST", "/load", {"model": model, "timeout": wait})
        return result

    def unload(self, model: str, wait: float) -> dict[str, Any]:
        """Unload ``model`` once its requests end; its row, ``unloaded`` saying whether it went
        within ``wait`` seconds."""
        result: dict[str, Any] = self._call("POST", "/unload", {"model": model, "timeout": wait})
        return result

    def drop_disk(self, model: str) -> dict[str, Any]:
        """Remove the disk tier's entry files of ``model``, which is not loaded: ``model``,
        ``directory``, ``entries`` and ``bytes`` removed. A loaded model is refused (409)."""
        result: dict[str, Any] = self._call("POST", "/drop-disk", {"model": model})
        return result
