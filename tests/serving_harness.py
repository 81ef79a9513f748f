"""A real vqpoold with real vqpool-worker processes, for the serving tests.

:class:`ServingStack` starts a daemon on a fresh short run directory and workers on built-in
models (all processes started at once, then awaited), and reads the pool's state through the
admin socket. Nothing is mocked: requests go over HTTP to the worker processes.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from daemon_harness import remove_tree, short_tmpdir
from vqpool.worker.models.memory import weights_bytes
from vqpool.worker.models.tiny_models import build_tiny_model
from vqpool.worker.testing.http_client import HttpReply, request_json
from vqpool.worker.testing.launch import DaemonProcess, WorkerProcess


def builtin_weights(*models: str) -> int:
    """Bytes of the weights of the built-in ``models`` (``builtin:llama``...) as their workers
    load them and charge them to the budget (seed 0): a test's budget sized for KV adds them."""
    total = 0
    for model in models:
        built, _ = build_tiny_model(model.removeprefix("builtin:"), seed=0)
        total += weights_bytes(built)
    return total


def run_worker_until_exit(
    run_dir: Path, *args: str, timeout: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """``vqpool-worker --model builtin:llama`` on ``run_dir`` with ``args``, run to its exit
    (for options that must stop it at start), its output captured."""
    command = [sys.executable, "-m", "vqpool.worker.serve", "--model", "builtin:llama"]
    return subprocess.run(
        [*command, "--port", "0", "--run-dir", str(run_dir), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class ServingStack:
    """One daemon (``daemon_args``) and one worker per model in ``models`` (``worker_args``)."""

    def __init__(
        self,
        models: Sequence[str],
        daemon_args: Sequence[str] = ("--n-blocks", "512", "--lease", "1"),
        worker_args: Sequence[str] = (),
    ) -> None:
        self.base = short_tmpdir("vqs")
        self.run_dir = self.base / "run"
        self.daemon = DaemonProcess(self.run_dir, *daemon_args)
        self.workers: dict[str, WorkerProcess] = {}
        self._models = list(models)
        self._worker_args = list(worker_args)

    def start(self) -> ServingStack:
        self.daemon.start()
        for model in self._models:
            self.workers[model] = self.start_worker(model, self._worker_args, wait=False)
        for worker in self.workers.values():
            worker.wait_ready()
        return self

    def start_worker(
        self, model: str, args: Sequence[str] = (), wait: bool = True, name: str | None = None
    ) -> WorkerProcess:
        # A model given as a path would make the log path absolute: one log for every stack.
        label = (name or model).replace(":", "_").replace("/", "_")
        log_path = self.base / f"{label}.log"
        worker = WorkerProcess(model, log_path, run_dir=self.run_dir, args=args)
        return worker.start(wait=wait)

    def url(self, model: str) -> str:
        return self.workers[model].url

    def complete(
        self, model: str, body: dict[str, Any], path: str = "/v1/completions"
    ) -> HttpReply:
        return request_json(self.url(model), "POST", path, body)

    def send_request(self, model: str, body: bytes) -> socket.socket:
        """POST ``body`` to the model's /v1/completions on a raw connection, the reply unread:
        close the socket to play a client that goes away."""
        url = urlsplit(self.url(model))
        client = socket.create_connection((url.hostname, url.port))
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        return client

    def worker_stats(self, model: str) -> dict[str, Any]:
        reply = request_json(self.url(model), "GET", "/v1/stats")
        assert reply.status == 200, reply
        stats: dict[str, Any] = reply.body
        return stats

    def blocks_by_model(self) -> dict[str, int]:
        """Blocks each model's sessions hold now, per the daemon (K and V counted apart)."""
        held: dict[str, int] = {}
        for session in self.daemon.admin("sessions"):
            held[session["model"]] = held.get(session["model"], 0) + session["n_blocks"]
        return held

    def pool_streams(self) -> dict[str, dict[str, int]]:
        streams: dict[str, dict[str, int]] = self.daemon.admin("stats")["streams"]
        return streams

    def blocks_in_use(self) -> int:
        return sum(s["total"] - s["free"] for s in self.pool_streams().values())

    def wait_for_no_blocks(self, timeout: float = 10.0) -> None:
        """Tell the workers to drop their prompt caches until no block is in use and no owner
        is active (AssertionError otherwise). Dropped again while waiting: requests a test has
        just closed end at their worker's next step, and an ended or preempted request stores
        its prompt in the cache after the first drop."""
        deadline = time.monotonic() + timeout
        next_drop = 0.0
        while time.monotonic() < deadline:
            if time.monotonic() >= next_drop:
                for model in {session["model"] for session in self.daemon.admin("sessions")}:
                    self.daemon.admin("cache_drop", model=model)
                next_drop = time.monotonic() + 0.5
            if self.blocks_in_use() == 0 and not self.daemon.admin("owners"):
                self.daemon.audit()
                return
            time.sleep(0.05)
        raise AssertionError(f"blocks still in use after {timeout}s: {self.daemon.admin('owners')}")

    def logs(self) -> str:
        return "\n".join(f"--- {m}\n{w.log()[-3000:]}" for m, w in self.workers.items())

    def stop(self) -> None:
        for worker in self.workers.values():
            if worker.process is not None:
                worker.stop()
        self.daemon.stop()
        remove_tree(self.base)


def greedy_token_ids(url: str, prompt: str, max_tokens: int, **fields: Any) -> list[int]:
    """The token ids of a temperature-0 completion of ``prompt`` (asserted 200); ``fields`` are
    added to the body (or replace its own)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    reply = request_json(url, "POST", "/v1/completions", {**body, **fields})
    assert reply.status == 200, reply
    ids: list[int] = reply.body["choices"][0]["token_ids"]
    return ids
