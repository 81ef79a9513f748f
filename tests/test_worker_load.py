"""Workers report the requests they run and queue in their heartbeat ``ping``; the daemon shows
them per session (what ``vqpoolctl watch`` and ``sessions`` print). Bad counts are refused and
change nothing; a real vqpool-worker reports its scheduler's counts as they change."""

from __future__ import annotations

import threading
from typing import Any

from daemon_harness import AgentProcess, RawClient, wait_until
from serving_harness import ServingStack
from vqpool.shared.errors import ErrorCode
from vqpool.worker.testing.http_client import stream_events
from vqpool.worker.testing.launch import DaemonProcess


def _session(daemon: DaemonProcess, pid: int) -> dict[str, Any]:
    (session,) = [s for s in daemon.admin("sessions") if s["pid"] == pid]
    return session


def test_reported_load_reaches_the_daemon_soon(start_daemon: Any, start_worker: Any) -> None:
    daemon: DaemonProcess = start_daemon("--n-blocks", "64", "--lease", "10")
    worker: AgentProcess = start_worker(daemon.run_dir, "loaded")
    quiet: AgentProcess = start_worker(daemon.run_dir, "quiet")
    assert _session(daemon, worker.pid)["running"] is None  # never reported
    worker.call("report_load", 3, 5)
    # Sent by the heartbeat thread at once, not at its next periodic ping (lease / 4 = 2.5 s).
    wait_until(lambda: _session(daemon, worker.pid)["running"] == 3, timeout=1.0)
    assert _session(daemon, worker.pid)["queued"] == 5
    worker.call("report_load", 0, 0)
    wait_until(lambda: _session(daemon, worker.pid)["queued"] == 0, timeout=1.0)
    assert _session(daemon, worker.pid)["running"] == 0
    assert _session(daemon, quiet.pid)["queued"] is None


def test_bad_load_counts_are_refused_and_change_nothing(daemon: DaemonProcess) -> None:
    client = RawClient(daemon.run_dir)
    try:
        client.hello(model="raw")
        assert client.call("ping", {"running": 2, "queued": 1})["ok"]
        for args in (
            {"running": -1},
            {"queued": "many"},
            {"running": 1 << 40},
            {"running": True},
            {"load": 1},
        ):
            reply = client.call("ping", args)
            assert not reply["ok"] and reply["error"]["code"] == ErrorCode.BAD_REQUEST, args
        (session,) = daemon.admin("sessions")
        assert (session["running"], session["queued"]) == (2, 1)
    finally:
        client.close()


def test_serving_worker_reports_running_and_queued_requests() -> None:
    stack = ServingStack(["builtin:llama"], worker_args=["--max-concurrent", "1"]).start()
    try:
        pid = stack.workers["builtin:llama"].pid

        def load() -> tuple[int, int]:
            session = _session(stack.daemon, pid)
            return session["running"], session["queued"]

        wait_until(lambda: load() == (0, 0), timeout=5.0)  # reported from the start
        url = stack.url("builtin:llama")
        body = {"prompt": "count the blocks " * 4, "max_tokens": 400, "stream": True}

        def client() -> None:
            for _ in stream_events(url, "/v1/completions", body):
                pass

        clients = [threading.Thread(target=client) for _ in range(3)]
        for thread in clients:
            thread.start()
        wait_until(lambda: load() == (1, 2), timeout=20.0)
        for thread in clients:
            thread.join()
        wait_until(lambda: load() == (0, 0), timeout=5.0)
    finally:
        stack.stop()
