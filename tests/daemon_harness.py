"""Real worker processes and raw protocol clients for tests: no mocks anywhere. (The daemon
process, :class:`~vqpool.worker.testing.launch.DaemonProcess`, is shared with the benchmarks and
the demo.)

* :func:`short_tmpdir` makes a run directory short enough for a Unix socket path (pytest's
  ``tmp_path`` is often longer than the 107-byte limit allows).
* :class:`AgentProcess` starts ``worker_agent.py``: a separate process holding one PoolClient,
  driven over stdin/stdout, so ownership really crosses process boundaries.
* :class:`RawClient` speaks protocol v1 by hand on a bare DEALER, for frame-level tests.

Other test modules use these through the fixtures in ``conftest.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import zmq
from prometheus_client.parser import text_string_to_metric_families
from vqpool.shared import PoolConfig
from vqpool.shared.config import WORKER_SOCKET_NAME
from vqpool.shared.protocol import decode_reply, encode_request

WORKER_AGENT = Path(__file__).with_name("worker_agent.py")


def short_tmpdir(prefix: str = "vq") -> Path:
    """A new private directory under /tmp (short, for socket paths)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def daemon_args_for(config: PoolConfig) -> list[str]:
    """vqpoold options that build a pool with ``config``."""
    args = ["--n-blocks", str(config.n_blocks), "--block-size", str(config.block_size)]
    if not config.separate_kv:
        args.append("--shared-kv")
    if config.grow_on_exhaustion:
        args.append("--grow")
    if config.max_blocks is not None:
        args += ["--max-blocks", str(config.max_blocks)]
    return args


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


class AgentError(Exception):
    """An exception raised inside a worker process; ``kind`` is its class name."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class AgentProcess:
    """A ``worker_agent.py`` process: one PoolClient on ``run_dir``, driven op by op (not a
    ``vqpool-worker``; that is :class:`vqpool.worker.testing.launch.WorkerProcess`)."""

    def __init__(self, run_dir: Path, name: str, *, quantized_formats: bool = False) -> None:
        """``quantized_formats``: the agent declares ``AGENT_BYTES_PER_FORMAT`` at hello (its
        ``fit`` is then priced at the costliest quantized format, as a quantizing worker's)."""
        self.name = name
        formats = ["--quantized-formats"] if quantized_formats else []
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER_AGENT), str(run_dir), name, *formats],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        hello = self._read()
        self.session_id: int = hello["sid"]

    @property
    def pid(self) -> int:
        return self.process.pid

    def _read(self) -> Any:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name} exited with {self.process.wait()}")
        reply = json.loads(line)
        if not reply["ok"]:
            raise AgentError(reply["error"], reply["message"])
        return reply["result"]

    def call(self, op: str, *args: Any) -> Any:
        """Run ``op`` in the worker; its result, or AgentError naming the exception raised."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, "args": list(args)}) + "\n")
        self.process.stdin.flush()
        return self._read()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (SIGKILL by default) without waiting."""
        os.kill(self.pid, sig)

    def stop(self) -> None:
        """End the worker (closing stdin ends its loop; killed if it does not exit)."""
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.close()
                self.process.wait(5)
            except (subprocess.TimeoutExpired, BrokenPipeError):
                self.process.kill()
                self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None and not stream.closed:
                stream.close()


def scrape_metrics(daemon_log: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples a daemon started with ``--metrics-port`` publishes now, by (name, sorted
    labels), from the address its log (``daemon_log``) announced."""
    match = re.search(r"metrics on (http://127\.0\.0\.1:\d+/metrics)", daemon_log)
    assert match, daemon_log
    with urllib.request.urlopen(match.group(1), timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def wait_until(condition: Any, timeout: float, interval: float = 0.02) -> float:
    """Poll ``condition()`` until true; the seconds it took (AssertionError on timeout)."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)
    return time.monotonic() - start


class RawClient:
    """A bare DEALER speaking protocol v1 by hand, for tests that need control over every frame
    (resends with the same id, stale boot ids, replies never read)."""

    def __init__(self, run_dir: Path, socket_name: str = WORKER_SOCKET_NAME) -> None:
        self.endpoint = f"ipc://{run_dir / socket_name}"
        self.context: zmq.Context[Any] = zmq.Context()
        self.socket = self._open()
        self.sid: int | None = None
        self.boot: str | None = None
        self.next_id = 1

    def _open(self) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        return sock

    def reopen(self) -> None:
        """Drop the socket (and anything queued on it) and connect a fresh one."""
        self.socket.close(linger=0)
        self.socket = self._open()

    def encode(self, op: str, args: dict[str, Any] | None = None, rid: int | None = None) -> bytes:
        if rid is None:
            rid = self.next_id
            self.next_id += 1
        return encode_request(rid, op, args or {}, self.sid, self.boot)

    def send(self, payload: bytes) -> None:
        self.socket.send(payload)

    def recv(self, timeout: float = 5.0) -> dict[str, Any]:
        if not self.socket.poll(int(timeout * 1000)):
            raise TimeoutError(f"no reply in {timeout}s")
        return decode_reply(self.socket.recv())

    def call(self, op: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        self.send(self.encode(op, args))
        return self.recv()

    def hello(
        self,
        pid: int | None = None,
        model: str = "raw",
        resumes: int | None = None,
        **declared: Any,
    ) -> dict[str, Any]:
        """Open a session (as process ``pid``, this one by default; after a restart, naming
        the session id it held, ``resumes``; with ``declared``'s hello arguments, e.g.
        ``weights``, ``bytes_per_block``)."""
        args = {"pid": pid or os.getpid(), "model": model, "nonce": os.urandom(8).hex()}
        if resumes is not None:
            args["resumes"] = resumes
        args.update(declared)
        reply = self.call("hello", args)
        assert reply["ok"], reply
        self.sid = reply["result"]["sid"]
        self.boot = reply["result"]["boot"]
        return dict(reply["result"])

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()
