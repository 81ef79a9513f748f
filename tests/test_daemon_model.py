"""Model-based test of the live daemon: the allocator state machine idea, across sessions.

Hypothesis drives three sessions against a real vqpoold: two worker processes
(tests/worker_agent.py) and one PoolClient in this process. Rules: allocate and register with
owner ids shared between sessions (collisions), frees, fill updates and free_all from the
holder and from other sessions (not-owner attempts), admin shrink, SIGKILL of a worker process
(replaced by a new one), and a SIGKILL + restart of the daemon (every session re-syncs). A
simple model predicts every outcome; after every step the daemon's admin audit must be clean
and its owners and per-stream counts must equal the model's.

The memory budget (issue 11) joins in: rules set the budget and a worker model's reserve,
limit and weight live, and every allocation of the two worker processes (4 KiB per block, one
model each) is predicted by the grant rule of docs/budget.md as well. After every step the
bytes held stay within the budget (unless it was lowered below them since) and within each
model's limit (likewise), the ledger equals the recount (the audit), and each model's bytes
equal the model's. The in-process session declares no bytes per block: the budget never bounds
it (which is also why the budget is set live: a daemon started with one refuses such a hello).

Blocks of several formats share the pool: each allocation picks fp16 or a quantized format, and
the two worker processes declare bytes per format (tests/worker_agent.py): the model prices each
block at its format's bytes, so after every step the ledger's bytes of each model equal the sum
over its held blocks of their format's bytes (also through a daemon restart's claims).

Issue 13: the same machine against a daemon that lends unused reserves (``--lend-reserves``),
where the grant rule keeps no model's unused reserve free and a request can never fit only
over its model's limit.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from daemon_harness import AgentError, AgentProcess, remove_tree, short_tmpdir
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from vqpool.daemon.budget.live_settings import LIVE_SETTINGS_FILE
from vqpool.worker import PoolClient
from vqpool.worker.testing.launch import DaemonProcess
from worker_agent import AGENT_BYTES_PER_FORMAT, run_op

BLOCK_SIZE = 16
PER_STREAM = 12
OPTIONS = ("--n-blocks", str(2 * PER_STREAM), "--lease", "1", "--claim-grace", "5")
OWNERS = st.sampled_from([1, 2, "a", "b", "c"])
STREAMS = st.sampled_from(["k", "v"])
BYTES_PER_BLOCK = 4096  # what worker_agent.py declares, every stream
FORMATS = st.sampled_from(["fp16", "q8g64", "q4g64"])


def format_bytes_of(fmt: str) -> int:
    """Bytes a worker process's block of format ``fmt`` costs."""
    return AGENT_BYTES_PER_FORMAT.get(fmt, BYTES_PER_BLOCK)


UNLIMITED = None


class InProcessSession:
    """A PoolClient in this process, called like a AgentProcess."""

    def __init__(self, run_dir: Any) -> None:
        self.pool = PoolClient(run_dir, name="in-process", timeout=10.0)
        self.pid = os.getpid()

    def call(self, op: str, *args: Any) -> Any:
        try:
            return run_op(self.pool, op, list(args))
        except Exception as exc:
            raise AgentError(type(exc).__name__, str(exc)) from None

    def stop(self) -> None:
        self.pool.close()


@dataclass
class ModelBudget:
    """A model's settings as the test set them (bytes)."""

    reserve: int = 0
    limit: int | None = None


@dataclass
class OwnerModel:
    session: int
    blocks: dict[str, list[int]] = field(default_factory=lambda: {"k": [], "v": []})
    formats: dict[int, str] = field(default_factory=dict)
    """Each held block's format."""

    def n_bytes(self) -> int:
        return sum(format_bytes_of(self.formats[b]) for ids in self.blocks.values() for b in ids)


class DaemonMachine(RuleBasedStateMachine):
    options: tuple[str, ...] = OPTIONS
    lend_reserves = False

    @initialize()
    def start(self) -> None:
        self.base = short_tmpdir()
        self.daemon = DaemonProcess(self.base / "run", *self.options).start()
        self.sessions: list[Any] = [
            AgentProcess(self.daemon.run_dir, "w0", quantized_formats=True),
            AgentProcess(self.daemon.run_dir, "w1", quantized_formats=True),
            InProcessSession(self.daemon.run_dir),
        ]
        self.owners: dict[Any, OwnerModel] = {}
        self.total = {"k": PER_STREAM, "v": PER_STREAM}
        self.models: list[str | None] = ["w0", "w1", None]  # None: not bounded by the budget
        self.budget: int | None = UNLIMITED
        self.settings: dict[str, ModelBudget] = {}
        self.may_exceed: set[str | None] = set()  # budget (None) or models lowered below holdings

    def teardown(self) -> None:
        if hasattr(self, "daemon"):
            for session in self.sessions:
                session.stop()
            self.daemon.stop()
            remove_tree(self.base)

    # -- model helpers -------------------------------------------------------------------------

    def held(self, stream: str) -> int:
        return sum(len(o.blocks[stream]) for o in self.owners.values())

    def bytes_held(self, model: str) -> int:
        return sum(o.n_bytes() for o in self.owners.values() if self.models[o.session] == model)

    def total_bytes(self) -> int:
        return sum(self.bytes_held(m) for m in {m for m in self.models if m is not None})

    def limit_of(self, model: str) -> int | None:
        """The model's limit in effect (None: unlimited)."""
        limit = self.settings.get(model, ModelBudget()).limit
        if self.budget is None:
            return limit
        return self.budget if limit is None else min(limit, self.budget)

    def budget_refusal(self, model: str | None, n_bytes: int) -> str | None:
        """The error the grant rule gives an allocation of ``n_bytes`` now, or None."""
        if model is None:
            return None
        budget = self.budget if self.budget is not None else 2**50
        limit = self.limit_of(model)
        limit = budget if limit is None else limit
        others = {m: s for m, s in self.settings.items() if m != model}
        ceiling = limit if self.lend_reserves else budget - sum(s.reserve for s in others.values())
        if n_bytes > min(limit, ceiling):
            return "OverBudgetError"
        held = self.bytes_held(model)
        protected = sum(max(0, s.reserve - self.bytes_held(m)) for m, s in others.items())
        if self.lend_reserves:
            protected = 0  # unused reserves are lent
        total = self.total_bytes()
        if held + n_bytes > limit or n_bytes > budget - total - protected:
            return "BlockPoolExhaustedError"
        return None

    def outcome(self, session: int, op: str, *args: Any) -> tuple[str, Any]:
        try:
            return "ok", self.sessions[session].call(op, *args)
        except AgentError as exc:
            return exc.kind, None

    # -- rules ---------------------------------------------------------------------------------

    @rule(
        session=st.integers(0, 2),
        stream=STREAMS,
        n_tokens=st.integers(1, 80),
        owner=OWNERS,
        fmt=FORMATS,
    )
    def allocate(self, session: int, stream: str, n_tokens: int, owner: Any, fmt: str) -> None:
        got = self.outcome(session, "allocate", stream, n_tokens, owner, fmt)
        model = self.owners.get(owner)
        n_needed = -(-n_tokens // BLOCK_SIZE)
        refusal = self.budget_refusal(self.models[session], n_needed * format_bytes_of(fmt))
        if model is not None and model.session != session:  # owners are checked first
            assert got[0] == "OwnerAlreadyActiveError", got
        elif refusal is not None:  # then the budget, then the ids
            assert got[0] == refusal, got
        elif self.total[stream] - self.held(stream) < n_needed:
            assert got[0] == "BlockPoolExhaustedError", got  # registers nothing on the daemon
        else:
            assert got[0] == "ok" and len(got[1]) == n_needed, got
            held = self.owners.setdefault(owner, OwnerModel(session))
            held.blocks[stream] += got[1]
            held.formats.update(dict.fromkeys(got[1], fmt))

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
        self.sessions[index] = AgentProcess(
            self.daemon.run_dir, f"w{index}-again", quantized_formats=True
        )
        self.models[index] = f"w{index}-again"
        # Its owners are freed within the reaping interval.
        for owner in [o for o, m in self.owners.items() if m.session == index]:
            del self.owners[owner]
        deadline_ok = self._wait(lambda: self.daemon.admin("stats")["sessions"] == 3)
        assert deadline_ok, "the killed worker's session was not reaped"

    @rule()
    def restart_daemon(self) -> None:
        self.daemon.stop(signal.SIGKILL)
        # Settings made live outlive a restart (tests/test_ctl_live_settings.py), but the
        # in-process session declares no bytes per block, so a budget kept would refuse its
        # hello: the new daemon starts from the options alone, as after removing the file.
        (self.daemon.run_dir / LIVE_SETTINGS_FILE).unlink(missing_ok=True)
        self.daemon = DaemonProcess(self.daemon.run_dir, *self.options).start()
        # Every session re-syncs (heartbeats every 0.25 s); the pool is rebuilt from the
        # options, so shrinks are undone, and every block held is claimed back.
        assert self._wait(lambda: not self.daemon.admin("stats")["claims"]["active"])
        claims = self.daemon.admin("stats")["claims"]
        # A session goes on the roll at the tick after its hello or before its first mutating
        # request, so one that held nothing yet may not be expected: all that were came back.
        assert claims["resynced"] == claims["expected"] and claims["owners_refused"] == 0, claims
        assert claims["owners_claimed"] == len(self.owners)
        # A session that held nothing is not awaited by the claims: make each re-sync now, so
        # a budget set next cannot refuse the in-process session's hello (it declares no bytes).
        for session in self.sessions:
            session.call("n_free", "k")
        self.total = {"k": PER_STREAM, "v": PER_STREAM}
        # Without the file the live settings are gone; claims are charged to their models.
        self.budget = UNLIMITED
        self.settings = {}
        self.may_exceed = set()

    @rule(n_blocks=st.integers(2, 30))
    def set_budget(self, n_blocks: int) -> None:
        budget = n_blocks * BYTES_PER_BLOCK
        reserved = sum(s.reserve for s in self.settings.values())
        try:
            view = self.daemon.admin("budget", bytes=budget)
        except ValueError as exc:
            assert reserved > budget, exc
            return
        assert reserved <= budget and view["budget"] == budget
        self.budget = budget
        if self.total_bytes() > budget:
            self.may_exceed.add(None)
        for name in {m for m in self.models if m is not None}:
            limit = self.limit_of(name)
            if limit is not None and self.bytes_held(name) > limit:
                self.may_exceed.add(name)

    @rule(
        index=st.integers(0, 1),
        reserve=st.integers(0, 8),
        limit=st.none() | st.integers(0, 20),
        weight=st.sampled_from([0.5, 1.0, 3.0]),
    )
    def set_model(self, index: int, reserve: int, limit: int | None, weight: float) -> None:
        name = self.models[index]
        assert name is not None
        wanted = ModelBudget(reserve * BYTES_PER_BLOCK, None if limit is None else limit * 4096)
        others = sum(s.reserve for m, s in self.settings.items() if m != name)
        budget = self.budget if self.budget is not None else 2**50
        valid = others + wanted.reserve <= budget and (
            wanted.limit is None or wanted.reserve <= wanted.limit
        )
        before = self.daemon.admin("model_list")
        try:
            view = self.daemon.admin(
                "model_set",
                create=True,
                model=name,
                reserve=wanted.reserve,
                limit=-1 if wanted.limit is None else wanted.limit,
                weight=weight,
            )
        except ValueError:
            assert not valid
            assert self.daemon.admin("model_list") == before
            return
        assert valid and (view["reserve"], view["limit"]) == (wanted.reserve, wanted.limit)
        self.settings[name] = wanted
        limit_now = self.limit_of(name)
        if limit_now is not None and self.bytes_held(name) > limit_now:
            self.may_exceed.add(name)

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
        self.budget_holds()
        streams = self.daemon.admin("stats")["streams"]
        for stream in ("k", "v"):
            assert streams[stream] == {
                "free": self.total[stream] - self.held(stream),
                "total": self.total[stream],
            }

    def budget_holds(self) -> None:
        """Bytes within the budget and the limits (unless lowered below them since), and each
        model's bytes as the model counts them."""
        listing = self.daemon.admin("model_list")
        held = {view["model"]: view["held"] for view in listing["models"]}
        for name in {m for m in self.models if m is not None}:
            assert held.get(name, 0) == self.bytes_held(name), (name, held)
            limit = self.limit_of(name)
            if limit is not None and self.bytes_held(name) <= limit:
                self.may_exceed.discard(name)
            if name not in self.may_exceed and limit is not None:
                assert self.bytes_held(name) <= limit
        total = listing["budget"]["total_held"]
        assert total == self.total_bytes()
        if self.budget is not None:
            assert listing["budget"]["budget"] == self.budget
            if total <= self.budget:
                self.may_exceed.discard(None)
            assert None in self.may_exceed or total <= self.budget


# Each example starts a daemon and two worker processes, and about one step in eight restarts the
# daemon (a third of a second each, with the re-syncs): 6 + 3 examples of 16 steps (was 10 + 5)
# still restart it and kill a worker several times per run; scripts/soak.py explores longer.
DaemonMachine.TestCase.settings = settings(
    max_examples=6,
    stateful_step_count=16,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestDaemonModel = DaemonMachine.TestCase


class LendingDaemonMachine(DaemonMachine):
    options = (*OPTIONS, "--lend-reserves")
    lend_reserves = True


LendingDaemonMachine.TestCase.settings = settings(
    max_examples=3,
    stateful_step_count=16,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLendingDaemonModel = LendingDaemonMachine.TestCase
