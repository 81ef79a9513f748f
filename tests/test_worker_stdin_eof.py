"""vqpool-worker --exit-on-stdin-eof: when the write end of its stdin pipe closes (its
supervisor died), the worker stops as on SIGTERM: the open stream ends, its blocks go back, its
session says goodbye, exit status 0. Without the option a closed stdin changes nothing."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import remove_tree, short_tmpdir
from vqpool.worker.testing.http_client import request_json, stream_events
from vqpool.worker.testing.launch import DaemonProcess, WorkerProcess

# A lease far longer than the test: a session that goes is one that said goodbye, not one reaped.
DAEMON_ARGS = ("--n-blocks", "4096", "--lease", "120")
STOP_BOUND = 20.0
"""Seconds a worker may take from its stdin's end to its exit (it takes well under one)."""


@pytest.fixture
def base() -> Iterator[Path]:
    path = short_tmpdir("vqe")
    yield path
    remove_tree(path)


@pytest.fixture
def workers() -> Iterator[list[WorkerProcess]]:
    """The workers a test starts; any still running at its end is killed."""
    started: list[WorkerProcess] = []
    yield started
    for worker in started:
        if worker.process is not None and worker.process.poll() is None:
            worker.stop(signal.SIGKILL)


def session_of(daemon: DaemonProcess, pid: int) -> dict[str, Any] | None:
    for session in daemon.admin("sessions"):
        if session["pid"] == pid:
            return dict(session)
    return None


class OpenStream:
    """A streaming completion read on its own thread: :attr:`first_chunk` is set once one
    chunk came, :attr:`ending` says how it ended once :attr:`thread` is done."""

    def __init__(self, url: str) -> None:
        self.first_chunk = threading.Event()
        self.finish_reasons: list[str] = []
        self.ending = ""
        self.thread = threading.Thread(target=self._read, args=(url,), daemon=True)
        self.thread.start()

    def _read(self, url: str) -> None:
        body = {"prompt": "x", "max_tokens": 20000}
        try:
            for event in stream_events(url, "/v1/completions", body, timeout=60):
                self.first_chunk.set()
                reason = event.get("choices", [{}])[0].get("finish_reason")
                if reason:
                    self.finish_reasons.append(reason)
            self.ending = "[DONE]"
        except Exception as exc:  # the worker stopping under it may cut the connection
            self.ending = repr(exc)


def test_stdin_eof_stops_the_worker_cleanly_under_a_running_stream(
    base: Path, start_daemon: Callable[..., DaemonProcess], workers: list[WorkerProcess]
) -> None:
    daemon = start_daemon(*DAEMON_ARGS)
    worker = WorkerProcess(
        "builtin:llama",
        base / "worker.log",
        run_dir=daemon.run_dir,
        args=["--exit-on-stdin-eof"],
        stdin_pipe=True,
    )
    workers.append(worker.start())
    stream = OpenStream(worker.url)
    assert stream.first_chunk.wait(30), (stream.ending, worker.log())
    session = session_of(daemon, worker.pid)
    assert session is not None and session["n_blocks"] > 0, session

    worker.close_stdin()
    assert worker.process is not None
    status = worker.process.wait(STOP_BOUND)
    stream.thread.join(STOP_BOUND)

    assert status == 0, worker.log()
    assert "stdin reached end of file" in worker.log()
    assert not stream.thread.is_alive(), "the stream hung after the worker stopped"
    # Ended by the stop, not run to its end: the premise (a request still running) held.
    assert stream.finish_reasons == [], (stream.finish_reasons, stream.ending)
    assert session_of(daemon, worker.pid) is None
    assert daemon.audit()["blocks_in_use"] == 0


def test_without_the_option_a_closed_stdin_changes_nothing(
    base: Path, start_daemon: Callable[..., DaemonProcess], workers: list[WorkerProcess]
) -> None:
    daemon = start_daemon(*DAEMON_ARGS)
    plain, watching = (
        WorkerProcess(
            "builtin:llama",
            base / f"{name}.log",
            run_dir=daemon.run_dir,
            args=args,
            stdin_pipe=True,
        ).start(wait=False)
        for name, args in (("plain", []), ("watching", ["--exit-on-stdin-eof"]))
    )
    workers += [plain, watching]
    plain.wait_ready()
    watching.wait_ready()

    plain.close_stdin()
    watching.close_stdin()
    # The worker with the option has seen its EOF and exited, so the plain one has had as long.
    assert watching.process is not None
    assert watching.process.wait(STOP_BOUND) == 0, watching.log()

    reply = request_json(plain.url, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 4})
    assert reply.status == 200, reply.body
    assert reply.body["choices"][0]["finish_reason"] == "length"
    assert plain.process is not None and plain.process.poll() is None
    assert session_of(daemon, plain.pid) is not None
    assert "stdin reached end of file" not in plain.log()
    assert plain.stop(signal.SIGTERM, timeout=STOP_BOUND) == 0, plain.log()
