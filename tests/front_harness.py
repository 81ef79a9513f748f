"""A real ``vqpool serve`` (front door, vqpoold, workers as its children) for the front-door tests.

:class:`FrontDoor` starts ``python -m vqpool.daemon.front serve`` on a fresh short run directory
and port 0, reads its ready line for the URL, and reads the models' state on its control socket.
:meth:`FrontDoor.stop` sends SIGTERM and returns the exit status once no process it started is
left.
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import psutil
from daemon_harness import remove_tree, short_tmpdir, wait_until
from vqpool.shared.admin_client import AdminClient
from vqpool.shared.front_client import FrontDoorClient
from vqpool.worker.testing.http_client import HttpReply, request_json

READY_TIMEOUT = 30.0
STOP_TIMEOUT = 40.0
_READY_LINE = re.compile(r"vqpool serve: serving .* on (http://\S+)")


class FrontDoor:
    """One ``vqpool serve`` with ``args`` (``--model builtin:llama`` ...) on its own run dir."""

    def __init__(self, *args: str, config: str | None = None, env: dict[str, str] | None = None):
        self.base = short_tmpdir("vqf")
        self.run_dir = self.base / "run"
        self.log_path = self.base / "serve.log"
        self.argv = [
            sys.executable,
            "-m",
            "vqpool.daemon.front",
            "serve",
            "--run-dir",
            str(self.run_dir),
            "--port",
            "0",
            *args,
        ]
        if config is not None:
            config_path = self.base / "vqpool.toml"
            config_path.write_text(config)
            self.argv += ["--config", str(config_path)]
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.start_output = ""
        """What it printed up to its ready line."""

    def start(self) -> FrontDoor:
        """Start it and wait for its ready line (AssertionError with its log if it exits)."""
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.argv, stdout=subprocess.PIPE, stderr=log, env=self.env
            )
        assert self.process.stdout is not None
        selector = selectors.DefaultSelector()
        selector.register(self.process.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + READY_TIMEOUT
        buffered = b""
        while time.monotonic() < deadline:
            if selector.select(timeout=0.1):
                chunk = os.read(self.process.stdout.fileno(), 4096)
                if not chunk:
                    break
                buffered += chunk
                match = _READY_LINE.search(buffered.decode(errors="replace"))
                if match:
                    self.url = match.group(1)
                    self.start_output = buffered.decode(errors="replace")
                    return self
        status = self.process.poll()
        raise AssertionError(f"vqpool serve did not serve (status {status}):\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    # -- requests --------------------------------------------------------------------------------

    def post(self, path: str, body: Any, timeout: float = 120.0) -> HttpReply:
        return request_json(self.url, "POST", path, body, timeout=timeout)

    def get(self, path: str, timeout: float = 30.0) -> HttpReply:
        return request_json(self.url, "GET", path, timeout=timeout)

    def complete(self, model: str, max_tokens: int = 4, **fields: Any) -> HttpReply:
        body = {"model": model, "prompt": "hello", "max_tokens": max_tokens, **fields}
        return self.post("/v1/completions", body)

    # -- state -----------------------------------------------------------------------------------

    def control(self, timeout: float = 30.0) -> FrontDoorClient:
        return FrontDoorClient(self.run_dir, timeout=timeout)

    def models(self) -> dict[str, dict[str, Any]]:
        """Each model's row (``vqpoolctl ps``), by name."""
        return {row["name"]: row for row in self.control().models()["models"]}

    def row(self, name: str) -> dict[str, Any]:
        return self.models()[name]

    def wait_state(self, name: str, state: str, timeout: float = 30.0) -> dict[str, Any]:
        wait_until(lambda: self.row(name)["state"] == state, timeout)
        return self.row(name)

    def admin(self, op: str, **args: Any) -> Any:
        with AdminClient(self.run_dir, timeout=5.0) as admin:
            return admin.call(op, **args)

    def sessions_of(self, model: str) -> list[dict[str, Any]]:
        """The daemon's sessions of ``model``'s workers."""
        return [s for s in self.admin("sessions") if s["model"] == model]

    def children(self) -> list[psutil.Process]:
        """Every process it started that still runs (workers, the daemon)."""
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    # -- stopping --------------------------------------------------------------------------------

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Send ``sig``; its exit status, once it and every process it started are gone."""
        assert self.process is not None
        children = self.children()
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            status = self.process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"vqpool serve did not stop on {sig}:\n{self.log()}") from None
        _, alive = psutil.wait_procs(children, timeout=STOP_TIMEOUT)
        for process in alive:
            process.kill()
        assert not alive, f"left running: {[p.pid for p in alive]}"
        return status

    def close(self) -> None:
        """Stop it if it runs (SIGKILL to whatever is left) and remove its directory."""
        if self.process is not None and self.process.poll() is None:
            children = self.children()
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            _, alive = psutil.wait_procs(children, timeout=10)
            for process in alive:
                process.kill()
        if self.process is not None and self.process.stdout is not None:
            self.process.stdout.close()
        remove_tree(self.base)

    def __enter__(self) -> FrontDoor:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def paths_for(models: Sequence[str]) -> list[str]:
    """``--model`` options for each of ``models``."""
    return [arg for model in models for arg in ("--model", model)]
