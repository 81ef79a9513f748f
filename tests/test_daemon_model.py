"""Model-based test of the live daemon: the allocator state machine idea, across sessions.

Hypothesis drives three sessions against a real vqpoold: two worker processes
(tests/worker_agent.py) and one PoolClient in this process. Rules: allocate and register with
owner ids shared between sessions (collisions), frees, fill updates and free_all from the
holder and from other sessions (not-owner attempts), admin shrink, SIGKILL of a worker process
(replaced by a new one), and a SIGKILL + restart of the daemon (every session re-syncs). A
simple model predicts every outcome; after every step the daemon's admin audit must be clean
and its owners and per-stream counts must equal the model's.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from daemon_harness import DaemonProcess, WorkerError, WorkerProcess, remove_tree, short_tmpdir
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from vqpool.worker import PoolClient
from worker_agent import run_op

BLOCK_SIZE = 16
PER_STREAM = 12
OPTIONS = ("--n-blocks", str(2 * PER_STREAM), "--lease", "1", "--claim-grace", "5")
OWNERS = st.sampled_from([1, 2, "a", "b", "c"])
STREAMS = st.sampled_from(["k", "v"])


class InProcessSession:
    """A PoolClient in this process, called like a WorkerProcess."""

    def __init__(self, run_dir: Any) -> None:
        self.pool = PoolClient(run_dir, name="in-process", timeout=10.0)
        self.pid = os.getpid()

    def call(self, op: str, *args: Any) -> Any:
        try:
            return run_op(self.pool, op, list(args))
        except Exception as exc:
            raise WorkerError(type(exc).__name__, str(exc)) from None

    def stop(self) -> None:
        self.pool.close()


@dataclass
class OwnerModel:
    session: int
    blocks: dict[str, list[int]] = field(default_factory=lambda: {"k": [], "v": []})


class DaemonMachine(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        self.base = short_tmpdir()
        self.daemon = DaemonProcess(self.base / "run", *OPTIONS).start()
        self.sessions: list[Any] = [
            WorkerProcess(self.daemon.run_dir, "w0"),
            WorkerProcess(self.daemon.run_dir, "w1"),
            InProcessSession(self.daemon.run_dir),
        ]
        self.owners: dict[Any, OwnerModel] = {}
        self.total = {"k": PER_STREAM, "v": PER_STREAM}

    def teardown(self) -> None:
        if hasattr(self, "daemon"):
            for session in self.sessions:
                session.stop()
            self.daemon.stop()
            remove_tree(self.base)

    # -- model helpers -------------------------------------------------------------------------

    def held(self, stream: str) -> int:
        return sum(len(o.blocks[stream]) for o in self.owners.values())

    def outcome(self, session: int, op: str, *args: Any) -> tuple[str, Any]:
        try:
            return "ok", self.sessions[session].call(op, *args)
        except WorkerError as exc:
            return exc.kind, None

    # -- rules ---------------------------------------------------------------------------------

    @rule(session=st.integers(0, 2), stream=STREAMS, n_tokens=st.integers(1, 80), owner=OWNERS)
    def allocate(self, session: int, stream: str, n_tokens: int, owner: Any) -> None:
        got = self.outcome(session, "allocate", stream, n_tokens, owner)
        model = self.owners.get(owner)
        n_needed = -(-n_tokens // BLOCK_SIZE)
        if model is not None and model.session != session:
            assert got[0] == "OwnerAlreadyActiveError", got
        elif self.total[stream] - self.held(stream) < n_needed:
            assert got[0] == "BlockPoolExhaustedError", got  # registers nothing on the daemon
        else:
            assert got[0] == "ok" and len(got[1]) == n_needed, got
            self.owners.setdefault(owner, OwnerModel(session)).blocks[stream] += got[1]

    @rule(session=st.integers(0, 2), owner=OWNERS)
    def register_owner(self, session: int, owner: Any) -> None:
        got = self.outcome(session, "register_owner", owner)
        if owner in self.owners:
            assert got[0] == "OwnerAlreadyActiveError", got
        else:
            assert got[0] == "ok", got
            self.owners[owner] = OwnerModel(session)

    @precondition(lambda self: any(sum(map(len, o.blocks.values())) for o in self.owners.values()))
    @rule(data=st.data(), from_holder=st.booleans())
    def free_some(self, data: st.DataObject, from_holder: bool) -> None:
        owner = data.draw(
            st.sampled_from([o for o, m in self.owners.items() if any(m.blocks.values())])
        )
        model = self.owners[owner]
        ids = [b for blocks in model.blocks.values() for b in blocks]
        chosen = data.draw(st.lists(st.sampled_from(ids), min_size=1, unique=True))
        session = model.session if from_holder else (model.session + 1) % 3
        got = self.outcome(session, "free", chosen)
        if not from_holder:
            assert got[0] == "NotOwnerError", got
            return
        assert got[0] == "ok", got
        for stream in model.blocks:
            model.blocks[stream] = [b for b in model.blocks[stream] if b not in chosen]
        if not any(model.blocks.values()):  # its last block: the owner is released
            del self.owners[owner]

    @precondition(lambda self: any(sum(map(len, o.blocks.values())) for o in self.owners.values()))
    @rule(data=st.data(), from_holder=st.booleans(), n_used=st.integers(0, BLOCK_SIZE))
    def mark_used(self, data: st.DataObject, from_holder: bool, n_used: int) -> None:
        owner = data.draw(
            st.sampled_from([o for o, m in self.owners.items() if any(m.blocks.values())])
        )
        model = self.owners[owner]
        block = data.draw(st.sampled_from([b for blocks in model.blocks.values() for b in blocks]))
        session = model.session if from_holder else (model.session + 2) % 3
        got = self.outcome(session, "mark_used", [[block, n_used]])
        assert got[0] == ("ok" if from_holder else "NotOwnerError"), got

    @rule(session=st.integers(0, 2), owner=OWNERS)
    def free_all(self, session: int, owner: Any) -> None:
        got = self.outcome(session, "free_all", owner)
        model = self.owners.get(owner)
        if model is not None and model.session != session:
            assert got[0] == "NotOwnerError", got
        else:
            assert got[0] == "ok", got
            self.owners.pop(owner, None)

    @rule(stream=STREAMS, target_free=st.integers(0, PER_STREAM))
    def shrink(self, stream: str, target_free: int) -> None:
        result = self.daemon.admin("shrink", stream=stream, target_free=target_free)
        n_free = self.total[stream] - self.held(stream)
        assert result["retired"] == max(0, n_free - target_free)
        self.total[stream] -= result["retired"]

    @rule(index=st.integers(0, 1))
    def kill_worker(self, index: int) -> None:
        worker = self.sessions[index]
        worker.kill()
        worker.process.wait()
        worker.stop()
        self.sessions[index] = WorkerProcess(self.daemon.run_dir, f"w{index}-again")
        # Its owners are freed within the reaping interval.
        for owner in [o for o, m in self.owners.items() if m.session == index]:
            del self.owners[owner]
        deadline_ok = self._wait(lambda: self.daemon.admin("stats")["sessions"] == 3)
        assert deadline_ok, "the killed worker's session was not reaped"

    @rule()
    def restart_daemon(self) -> None:
        self.daemon.stop(signal.SIGKILL)
        self.daemon = DaemonProcess(self.daemon.run_dir, *OPTIONS).start()
        # Every session re-syncs (heartbeats every 0.25 s); the pool is rebuilt from the
        # options, so shrinks are undone, and every block held is claimed back.
        assert self._wait(lambda: not self.daemon.admin("stats")["claims"]["active"])
        claims = self.daemon.admin("stats")["claims"]
        # A session goes on the roll at the tick after its hello or before its first mutating
        # request, so one that held nothing yet may not be expected: all that were came back.
        assert claims["resynced"] == claims["expected"] and claims["owners_refused"] == 0, claims
        assert claims["owners_claimed"] == len(self.owners)
        self.total = {"k": PER_STREAM, "v": PER_STREAM}

    @staticmethod
    def _wait(condition: Any, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return True
            time.sleep(0.02)
        return False

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def daemon_agrees_with_model(self) -> None:
        if not hasattr(self, "daemon"):
            return
        audit = self.daemon.admin("audit")
        assert audit["ok"], audit["problems"]
        pids = [s.pid for s in self.sessions]
        view = {
            row["owner"]: (row["pid"], row["blocks"].get("k", 0), row["blocks"].get("v", 0))
            for row in self.daemon.admin("owners")
        }
        want = {
            owner: (pids[m.session], len(m.blocks["k"]), len(m.blocks["v"]))
            for owner, m in self.owners.items()
        }
        assert view == want
        streams = self.daemon.admin("stats")["streams"]
        for stream in ("k", "v"):
            assert streams[stream] == {
                "free": self.total[stream] - self.held(stream),
                "total": self.total[stream],
            }


DaemonMachine.TestCase.settings = settings(
    max_examples=10,
    stateful_step_count=16,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestDaemonModel = DaemonMachine.TestCase
