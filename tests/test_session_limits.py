"""Sessions are bounded per process and in total; a refused hello changes nothing.

The daemon's cost per tick follows processes, not sessions, and opening a session no longer
rewrites the roll (scripts/bench_sessions.py measures both); here: the bounds and their error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from daemon_harness import AgentProcess, RawClient, wait_until
from vqpool.daemon.core.sessions import MAX_SESSIONS, MAX_SESSIONS_PER_PROCESS
from vqpool.shared.config import WORKER_SOCKET_NAME
from vqpool.shared.errors import ErrorCode
from vqpool.worker.testing.launch import DaemonProcess

StartWorker = Callable[[Path, str], AgentProcess]

# A process that opens sessions until refused, prints how many it got and the refusal, and keeps
# them (it stays alive) until its stdin closes.
SESSION_HOG = textwrap.dedent(
    """
    import json, os, sys
    import zmq
    from vqpool.shared.protocol import decode_reply, encode_request
    sock = zmq.Context().socket(zmq.DEALER)
    sock.connect(sys.argv[1])
    opened, refusal = 0, None
    while refusal is None and opened < int(sys.argv[2]):
        args = {"pid": os.getpid(), "model": "hog", "nonce": f"{os.getpid()}-{opened}"}
        sock.send(encode_request(opened + 1, "hello", args))
        reply = decode_reply(sock.recv())
        if reply["ok"]:
            opened += 1
        else:
            refusal = reply["error"]
    print(json.dumps({"opened": opened, "refusal": refusal}), flush=True)
    sys.stdin.read()
    """
)


def hello(client: RawClient, nonce: str) -> dict[str, Any]:
    return client.call("hello", {"pid": os.getpid(), "model": "many", "nonce": nonce})


def test_sessions_per_process_are_bounded(daemon: DaemonProcess, start_worker: StartWorker) -> None:
    client = RawClient(daemon.run_dir)
    try:
        sids = [hello(client, f"n{i}")["result"]["sid"] for i in range(MAX_SESSIONS_PER_PROCESS)]
        refused = hello(client, "one-too-many")
        assert refused["error"]["code"] == ErrorCode.TOO_MANY_SESSIONS, refused
        assert f"{MAX_SESSIONS_PER_PROCESS} sessions" in refused["error"]["message"]
        # A repeated hello (a lost reply) still returns its session: it opens nothing.
        assert hello(client, "n0")["result"]["sid"] == sids[0]
        assert daemon.admin("stats")["sessions"] == MAX_SESSIONS_PER_PROCESS
        # Another process is not held back by this one, and an ended session frees a slot.
        worker = start_worker(daemon.run_dir, "neighbour")
        assert len(worker.call("allocate", "k", 16, "w")) == 1
        client.sid, client.boot = sids[0], refused["boot"]
        assert client.call("goodbye")["result"]["ended"]
        assert hello(client, "again")["ok"]
        daemon.audit()
    finally:
        client.close()


def test_sessions_in_total_are_bounded(daemon: DaemonProcess) -> None:
    endpoint = f"ipc://{daemon.run_dir / WORKER_SOCKET_NAME}"
    n_processes = MAX_SESSIONS // MAX_SESSIONS_PER_PROCESS + 1
    hogs = [
        subprocess.Popen(
            [sys.executable, "-c", SESSION_HOG, endpoint, str(MAX_SESSIONS_PER_PROCESS)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(n_processes)
    ]
    try:
        reports = [json.loads(hog.stdout.readline()) for hog in hogs if hog.stdout is not None]
        assert sum(report["opened"] for report in reports) == MAX_SESSIONS
        refusals = [report["refusal"] for report in reports if report["refusal"] is not None]
        assert refusals and all(r["code"] == ErrorCode.TOO_MANY_SESSIONS for r in refusals)
        assert f"{MAX_SESSIONS} sessions" in refusals[0]["message"]
        assert daemon.admin("stats")["sessions"] == MAX_SESSIONS
    finally:
        for hog in hogs:
            hog.communicate()


def test_every_session_of_a_killed_process_is_reaped(daemon: DaemonProcess) -> None:
    # Liveness is one look per process: all of its sessions go when it does.
    endpoint = f"ipc://{daemon.run_dir / WORKER_SOCKET_NAME}"
    hog = subprocess.Popen(
        [sys.executable, "-c", SESSION_HOG, endpoint, "3"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert hog.stdout is not None
        assert json.loads(hog.stdout.readline())["opened"] == 3
        assert daemon.admin("stats")["sessions"] == 3
        hog.kill()
        wait_until(lambda: daemon.admin("stats")["sessions"] == 0, timeout=2.0)
        assert daemon.admin("stats")["sessions_reaped"] == 3
    finally:
        hog.kill()
        hog.communicate()
