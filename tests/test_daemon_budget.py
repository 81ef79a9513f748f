"""The memory budget in a real vqpoold (issue 11): refusals, byte-exact fills, reserves, parked
allocations (granted, in weighted order, expired, resent, dropped), live budget and model
settings, and fit answers. Raw protocol clients in this process, one session per model."""

from __future__ import annotations

import os
import re
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import AgentError, RawClient, scrape_metrics, short_tmpdir, wait_until
from vqpool.daemon.server.settings import MAX_IDS_PER_STREAM, DaemonSettings
from vqpool.shared.errors import BadRequestError, ErrorCode
from vqpool.shared.protocol.limits import (
    MAX_BYTES_PER_BLOCK,
    MAX_FIT_CONCURRENCY,
    MAX_FIT_CONTEXT,
)
from vqpool.worker.testing.launch import DaemonProcess

BLOCK = 16  # tokens per block (the daemon's default block size)


class ModelClient(RawClient):
    """A raw session of one model with declared bytes per block."""

    def __init__(
        self,
        run_dir: Path,
        model: str,
        bytes_per_block: int | dict[str, int],
        resumes: int | None = None,
    ) -> None:
        super().__init__(run_dir)
        hello: dict[str, Any] = {
            "pid": os.getpid(),
            "model": model,
            "nonce": os.urandom(8).hex(),
            "bytes_per_block": bytes_per_block,
        }
        if resumes is not None:
            hello["resumes"] = resumes
        reply = self.call("hello", hello)
        assert reply["ok"], reply
        self.sid = reply["result"]["sid"]
        self.boot = reply["result"]["boot"]

    def allocate(self, owner: str, n_blocks: int, wait: float = 0.0) -> dict[str, Any]:
        return self.call(
            "allocate",
            {"stream": "k", "n_tokens": n_blocks * BLOCK, "owner": owner, "wait": wait},
        )

    def send_allocate(self, owner: str, n_blocks: int, wait: float, rid: int | None = None) -> int:
        """Send an allocate without reading its reply; its request id."""
        if rid is None:
            rid = self.next_id
            self.next_id += 1
        args = {"stream": "k", "n_tokens": n_blocks * BLOCK, "owner": owner, "wait": wait}
        self.send(self.encode("allocate", args, rid))
        return rid

    def no_reply(self, timeout: float = 0.3) -> bool:
        return not self.socket.poll(int(timeout * 1000))

    def claim(self, owner: str, block_ids: list[int], done: bool = True) -> dict[str, Any]:
        """Claim ``block_ids`` of stream k for ``owner``: the reply."""
        return self.call(
            "claim", {"owners": [[owner, [["k", "fp16", block_ids, None]]]], "done": done}
        )


@pytest.fixture
def clients() -> Iterator[Callable[..., ModelClient]]:
    opened: list[ModelClient] = []

    def connect(daemon: DaemonProcess, model: str, bytes_per_block: int) -> ModelClient:
        client = ModelClient(daemon.run_dir, model, bytes_per_block)
        opened.append(client)
        return client

    yield connect
    for client in opened:
        client.close()


def budget_daemon(
    start: Callable[..., DaemonProcess], *args: str, run_dir: Path | None = None
) -> DaemonProcess:
    return start("--n-blocks", "512", "--lease", "2", *args, run_dir=run_dir)


def error_code(reply: dict[str, Any]) -> int:
    assert not reply["ok"], reply
    return int(reply["error"]["code"])


def test_refusals_leave_state_unchanged(start_daemon, clients) -> None:
    daemon = budget_daemon(start_daemon, "--budget", "10000")
    a = clients(daemon, "a", 1000)
    assert a.allocate("a1", 4)["ok"]
    before = (daemon.admin("budget"), daemon.admin("stats")["stats"])
    never = a.allocate("a2", 11, wait=5)  # over the whole budget: at once, never queued
    assert error_code(never) == ErrorCode.OVER_BUDGET
    assert "never" in never["error"]["message"]
    short = a.allocate("a2", 7)  # 4 + 7 > 10 blocks' worth: not now
    assert error_code(short) == ErrorCode.POOL_EXHAUSTED
    assert "budget" in short["error"]["message"]
    assert (daemon.admin("budget"), daemon.admin("stats")["stats"]) == before
    assert daemon.admin("budget")["total_held"] == 4000
    daemon.audit()


def test_two_block_sizes_fill_the_budget_to_the_byte(start_daemon, clients) -> None:
    daemon = budget_daemon(start_daemon, "--budget", "7000")
    small = clients(daemon, "small", 1000)
    big = clients(daemon, "big", 1500)
    assert big.allocate("b", 2)["ok"]  # 3000
    assert small.allocate("s", 4)["ok"]  # 4000: 7000 in all
    view = daemon.admin("budget")
    assert (view["budget"], view["total_held"], view["free"]) == (7000, 7000, 0)
    assert error_code(small.allocate("s2", 1)) == ErrorCode.POOL_EXHAUSTED
    assert error_code(big.allocate("b2", 1)) == ErrorCode.POOL_EXHAUSTED
    held = {m["model"]: m["held"] for m in daemon.admin("model_list")["models"]}
    assert held == {"small": 4000, "big": 3000}
    daemon.audit()


def test_a_third_models_reserve_is_kept_while_others_are_saturated(start_daemon, clients) -> None:
    daemon = budget_daemon(start_daemon, "--budget", "10000")
    daemon.admin("model_set", create=True, model="c", reserve=3000)
    a = clients(daemon, "a", 1000)
    b = clients(daemon, "b", 500)
    assert a.allocate("a", 4)["ok"]
    assert b.allocate("b", 6)["ok"]  # 4000 + 3000: everything but c's reserve
    assert error_code(a.allocate("a2", 1)) == ErrorCode.POOL_EXHAUSTED
    assert error_code(b.allocate("b2", 1)) == ErrorCode.POOL_EXHAUSTED
    c = clients(daemon, "c", 1000)
    assert c.allocate("c", 3)["ok"]
    assert daemon.admin("budget")["free"] == 0
    daemon.audit()


def test_a_parked_allocate_is_granted_when_another_model_frees(start_daemon, clients) -> None:
    daemon = budget_daemon(start_daemon, "--budget", "4000")
    a = clients(daemon, "a", 1000)
    b = clients(daemon, "b", 1000)
    assert a.allocate("a", 4)["ok"]
    b.send_allocate("b", 2, wait=10)
    assert b.no_reply()
    assert daemon.admin("budget")["waiting"] == 1
    assert a.call("free_all", {"owner": "a"})["ok"]
    granted = b.recv()
    assert granted["ok"] and len(granted["result"]) == 2
    assert daemon.admin("budget")["total_held"] == 2000
    daemon.audit()


def test_an_owner_of_another_session_is_refused_before_the_budget(start_daemon, clients) -> None:
    # Every check before the ledger: a request that can only fail is refused as what it is at
    # once, never parked behind a full budget nor charged.
    daemon = budget_daemon(start_daemon, "--budget", "4000")
    a = clients(daemon, "a", 1000)
    b = clients(daemon, "b", 1000)
    assert a.allocate("a", 4)["ok"]
    assert error_code(b.allocate("a", 1, wait=10)) == ErrorCode.OWNER_ALREADY_ACTIVE
    assert error_code(b.allocate("b", 70000, wait=10)) == ErrorCode.INVALID_VALUE
    assert daemon.admin("budget")["waiting"] == 0
    daemon.audit()


def test_a_shared_kv_pool_prices_blocks_asked_for_under_any_stream(start_daemon, clients) -> None:
    # The pool puts "k" in its one stream "kv": the charge must be that stream's price, as the
    # refund is, or the budget is bypassed and the refund of a free is more than was charged.
    daemon = budget_daemon(start_daemon, "--shared-kv", "--budget", "4000")
    a = clients(daemon, "a", {"kv": 1000})
    assert a.allocate("a", 3)["ok"]
    assert daemon.admin("budget")["total_held"] == 3000
    assert error_code(a.allocate("a2", 2)) == ErrorCode.POOL_EXHAUSTED
    assert a.call("free_all", {"owner": "a"})["ok"]
    assert daemon.admin("budget")["total_held"] == 0
    assert a.allocate("a", 4)["ok"]
    assert a.call("goodbye")["ok"]
    assert daemon.admin("budget")["total_held"] == 0
    assert daemon.audit()["ok"]


def test_parked_requests_are_granted_in_weighted_order(start_daemon, clients) -> None:
    daemon = budget_daemon(start_daemon, "--budget", "6000")
    daemon.admin("model_set", create=True, model="heavy", weight=2.0)
    x = clients(daemon, "x", 1000)
    light = clients(daemon, "light", 1000)
    heavy = clients(daemon, "heavy", 1000)
    assert light.allocate("l", 1)["ok"]
    assert heavy.allocate("h", 1)["ok"]
    assert x.allocate("x", 4)["ok"]
    light.send_allocate("l2", 1, wait=10)  # first to wait, but holds 1000 / weight 1
    assert light.no_reply(0.1)
    heavy.send_allocate("h2", 1, wait=10)  # holds 1000 / weight 2: served first
    assert heavy.no_reply(0.1)
    x_blocks = x.call("blocks_for", {"owner": "x"})["result"]
    assert x.call("free", {"block_ids": [x_blocks[0][0]]})["ok"]
    assert heavy.recv()["ok"]
    assert light.no_reply()
    assert x.call("free", {"block_ids": [x_blocks[1][0]]})["ok"]
    assert light.recv()["ok"]
    daemon.audit()


def test_a_parked_allocate_expires_at_its_deadline(start_daemon, clients) -> None:
    daemon = budget_daemon(start_daemon, "--budget", "2000")
    a = clients(daemon, "a", 1000)
    assert a.allocate("a", 2)["ok"]
    a.send_allocate("a2", 1, wait=0.3)
    reply = a.recv(timeout=3)
    assert error_code(reply) == ErrorCode.POOL_EXHAUSTED
    assert "waited 0.3s" in reply["error"]["message"]
    assert daemon.admin("budget")["waiting"] == 0
    daemon.audit()


def test_a_resent_parked_allocate_is_not_queued_twice(start_daemon, clients) -> None:
    daemon = budget_daemon(start_daemon, "--budget", "2000")
    a = clients(daemon, "a", 1000)
    b = clients(daemon, "b", 1000)
    assert a.allocate("a", 2)["ok"]
    rid = b.send_allocate("b", 1, wait=10)
    assert b.no_reply(0.1)
    b.reopen()  # Lazy Pirate: a new socket, the same request
    b.send_allocate("b", 1, wait=10, rid=rid)
    assert b.no_reply(0.1)
    assert daemon.admin("budget")["waiting"] == 1
    assert a.call("free_all", {"owner": "a"})["ok"]
    first = b.recv()
    assert first["ok"] and first["id"] == rid
    assert b.no_reply(0.2)  # one reply, on the newest socket
    b.send_allocate("b", 1, wait=10, rid=rid)  # a late resend gets the cached reply
    assert b.recv() == first
    assert daemon.admin("budget")["total_held"] == 1000
    daemon.audit()


def test_a_parked_allocate_is_dropped_when_its_session_ends(start_daemon, clients) -> None:
    daemon = budget_daemon(start_daemon, "--budget", "2000")
    a = clients(daemon, "a", 1000)
    b = clients(daemon, "b", 1000)
    assert a.allocate("a", 2)["ok"]
    b.send_allocate("b", 1, wait=10)
    assert b.no_reply(0.1)
    assert b.call("goodbye")["ok"]
    assert daemon.admin("budget")["waiting"] == 0
    assert a.call("free_all", {"owner": "a"})["ok"]
    assert b.no_reply()
    assert daemon.admin("budget")["total_held"] == 0
    daemon.audit()


def test_lowering_the_budget_stops_grants_until_holdings_fall_under(start_daemon, clients) -> None:
    daemon = budget_daemon(start_daemon, "--budget", "8000")
    a = clients(daemon, "a", 1000)
    assert a.allocate("a", 5)["ok"]
    view = daemon.admin("budget", bytes=3000)
    assert view["budget"] == 3000 and view["over_budget"] and view["free"] == 0
    assert error_code(a.allocate("a2", 1)) == ErrorCode.POOL_EXHAUSTED
    blocks = [row[0] for row in a.call("blocks_for", {"owner": "a"})["result"]]
    assert a.call("free", {"block_ids": blocks[:3]})["ok"]  # 2000 held
    assert a.allocate("a2", 1)["ok"]
    assert not daemon.admin("budget")["over_budget"]
    daemon.audit()


def test_a_budget_change_refuses_parked_requests_it_makes_impossible(start_daemon, clients) -> None:
    daemon = budget_daemon(start_daemon, "--budget", "4000")
    a = clients(daemon, "a", 1000)
    b = clients(daemon, "b", 1000)
    assert a.allocate("a", 4)["ok"]
    b.send_allocate("b", 3, wait=10)
    assert b.no_reply(0.1)
    assert daemon.admin("budget", bytes=2000)["refused"] == 1
    assert error_code(b.recv()) == ErrorCode.OVER_BUDGET
    daemon.audit()


def test_model_set_validates_and_changes_nothing_when_refused(start_daemon) -> None:
    daemon = budget_daemon(start_daemon, "--budget", "10000")
    view = daemon.admin("model_set", create=True, model="m", reserve=2000, limit=6000, weight=2.0)
    assert (view["reserve"], view["limit"], view["weight"], view["configured"]) == (
        2000,
        6000,
        2.0,
        True,
    )
    before = daemon.admin("model_list")
    for bad in (
        {"reserve": 20000},  # reserves over the budget
        {"reserve": 7000},  # over its limit
        {"weight": 0.0},
        {"limit": -2},
    ):
        with pytest.raises(ValueError):
            daemon.admin("model_set", create=True, model="m", **bad)
    assert daemon.admin("model_list") == before
    assert daemon.admin("model_set", create=True, model="m", limit=-1)["limit"] is None


def test_fit_answers_each_verdict(start_daemon, clients) -> None:
    daemon = budget_daemon(start_daemon, "--budget", "16000")
    daemon.admin("model_set", create=True, model="llama", reserve=4000, limit=10000)
    daemon.admin("model_set", create=True, model="qwen", reserve=2000)
    llama = clients(daemon, "llama", {"k": 500, "v": 500})
    qwen = clients(daemon, "qwen", 1000)
    assert llama.allocate("l", 3)["ok"]  # 1500
    assert qwen.allocate("q", 12)["ok"]  # 12000: 2500 free
    # One sequence of 32 tokens of llama: 2 blocks of k and of v, 2000 bytes.
    answers = {
        c: daemon.admin("fit", model="llama", context=32, concurrency=c) for c in (1, 2, 4, 6)
    }
    assert answers[1]["verdict"] == "now" and answers[1]["bytes_per_sequence"] == 2000
    assert answers[1]["max_concurrency_now"] == 1
    assert answers[1]["max_concurrency_ever"] == 5  # its 10000 limit
    assert answers[2]["verdict"] == "within_reserve"
    assert answers[4]["verdict"] == "after_others_return"
    assert answers[6]["verdict"] == "never"
    assert answers[6]["limit"] == 10000 and answers[6]["budget"] == 16000
    worker_side = llama.call("fit", {"context": 32, "concurrency": 2})
    assert answers[2].pop("model") == "llama"  # the admin op names the model it priced
    assert worker_side["ok"] and worker_side["result"] == answers[2]
    with pytest.raises(ValueError, match="no worker of model gemma"):
        daemon.admin("fit", model="gemma", context=32)


def test_fit_past_any_real_context_or_concurrency_is_a_bad_request(start_daemon, clients) -> None:
    daemon = budget_daemon(start_daemon, "--budget", "16000")
    llama = clients(daemon, "llama", {"k": 500, "v": 500})
    for args in (
        {"context": 2**62},
        {"context": MAX_FIT_CONTEXT + 1},
        {"context": 32, "concurrency": MAX_FIT_CONCURRENCY + 1},
        {"context": 32, "concurrency": 2**62},
    ):
        reply = llama.call("fit", args)
        assert error_code(reply) == ErrorCode.BAD_REQUEST, (args, reply)
        assert "fit." in reply["error"]["message"], reply
        with pytest.raises(BadRequestError, match=r"fit\.(context|concurrency) must be"):
            daemon.admin("fit", model="llama", **args)
    # The largest of both is answered: it can never fit, and the numbers say so.
    largest = {"context": MAX_FIT_CONTEXT, "concurrency": MAX_FIT_CONCURRENCY}
    reply = llama.call("fit", largest)
    assert reply["ok"] and reply["result"]["verdict"] == "never", reply
    assert reply["result"]["need"] == MAX_FIT_CONTEXT // BLOCK * 1000 * MAX_FIT_CONCURRENCY
    assert daemon.admin("fit", model="llama", **largest) == {"model": "llama", **reply["result"]}
    # Numbers past what the wire carries (the largest bytes per block a hello may declare):
    # a clear refusal, not INTERNAL.
    huge = clients(daemon, "huge", {"k": MAX_BYTES_PER_BLOCK, "v": MAX_BYTES_PER_BLOCK})
    reply = huge.call("fit", largest)
    assert error_code(reply) == ErrorCode.INVALID_VALUE, reply
    assert "bytes" in reply["error"]["message"], reply
    with pytest.raises(ValueError, match="bytes"):
        daemon.admin("fit", model="huge", **largest)
    daemon.audit()


def test_without_a_budget_nothing_binds_and_views_show_null(start_daemon, clients) -> None:
    daemon = budget_daemon(start_daemon)
    a = clients(daemon, "a", 1000)
    assert a.allocate("a", 3)["ok"]
    view = daemon.admin("stats")["budget"]
    assert view["budget"] is None and view["free"] is None and view["total_held"] == 3000
    models = daemon.admin("model_list")["models"]
    assert [(m["model"], m["held"], m["limit"], m["sessions"]) for m in models] == [
        ("a", 3000, None, 1)
    ]
    daemon.admin("model_set", create=True, model="a", limit=4000)
    assert error_code(a.allocate("a2", 2)) == ErrorCode.POOL_EXHAUSTED
    daemon.audit()


def test_hello_without_bytes_per_block_is_refused_under_a_budget(start_daemon) -> None:
    daemon = budget_daemon(start_daemon, "--budget", "1GiB")
    raw = RawClient(daemon.run_dir)
    try:
        reply = raw.call("hello", {"pid": os.getpid(), "model": "x", "nonce": "n1"})
        assert error_code(reply) == ErrorCode.INVALID_VALUE
        assert "bytes_per_block" in reply["error"]["message"]
        reply = raw.call(
            "hello",
            {"pid": os.getpid(), "model": "x", "nonce": "n2", "bytes_per_block": {"k": 1}},
        )
        assert error_code(reply) == ErrorCode.INVALID_VALUE
    finally:
        raw.close()


def test_hello_with_bytes_per_block_too_small_for_any_model_is_refused_under_a_budget(
    start_daemon,
) -> None:
    # 0 or 1 byte per block would let a session take blocks the ledger barely counts. The
    # floor at the default 16 slots per block: 16 x 16 = 256 bytes.
    daemon = budget_daemon(start_daemon, "--budget", "1GiB")
    raw = RawClient(daemon.run_dir)
    try:
        for index, bytes_per_block in enumerate([0, 1, 255, {"k": 4096, "v": 0}]):
            reply = raw.call(
                "hello",
                {
                    "pid": os.getpid(),
                    "model": "x",
                    "nonce": f"small-{index}",
                    "bytes_per_block": bytes_per_block,
                },
            )
            assert error_code(reply) == ErrorCode.INVALID_VALUE, bytes_per_block
            assert "256" in reply["error"]["message"], reply
        assert daemon.admin("stats")["sessions"] == 0
        reply = raw.call(
            "hello",
            {"pid": os.getpid(), "model": "x", "nonce": "floor", "bytes_per_block": 256},
        )
        assert reply["ok"], reply
    finally:
        raw.close()
    # Without a budget nothing is priced: any size (0 included) is taken.
    free = start_daemon("--n-blocks", "64")
    raw = RawClient(free.run_dir)
    try:
        reply = raw.call(
            "hello", {"pid": os.getpid(), "model": "x", "nonce": "zero", "bytes_per_block": 0}
        )
        assert reply["ok"], reply
    finally:
        raw.close()


def test_the_id_space_a_budget_sizes_is_priced_at_a_real_models_block() -> None:
    # 1 KiB per id made a 512 MiB budget a space of 1,048,576 ids (about 90 MiB of daemon
    # bookkeeping when filled); at the smallest built-in model's 4 KiB block, 262,144.
    settings = DaemonSettings()
    config = settings.pool_config(512 * 2**20)
    assert config.max_blocks == 2 * 131_072 and config.n_blocks == 1024
    assert settings.pool_config(2**50).max_blocks == 2 * MAX_IDS_PER_STREAM
    # A small budget still gets the default pool's 1,024 ids.
    assert settings.pool_config(64 * KIB).max_blocks == 1024
    shared = DaemonSettings(shared_kv=True).pool_config(512 * 2**20)
    assert shared.max_blocks == 131_072


@pytest.mark.parametrize(
    ("args", "toml", "message"),
    [
        (["--budget", "lots"], "", "budget"),
        (["--budget", "0"], "", "budget"),
        (["--budget", "150%"], "", "percentage"),
        (
            [],
            'budget = "4KiB"\n[models."a"]\nreserve = "3KiB"\n[models."b"]\nreserve = "2KiB"\n',
            "reserve",
        ),
        ([], '[models."a"]\nweight = 0\n', "weight"),
    ],
)
def test_bad_budget_settings_refuse_to_start(args: list[str], toml: str, message: str) -> None:
    base = short_tmpdir()
    try:
        if toml:
            (base / "vqpoold.toml").write_text(toml)
            args = [*args, "--config", str(base / "vqpoold.toml")]
        daemon = DaemonProcess(base / "run", *args).start(wait=False)
        assert daemon.process is not None
        assert daemon.process.wait(15) == 2
        lines = [line for line in daemon.log().splitlines() if line.strip()]
        assert message in lines[-1]
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_the_start_line_names_the_budget_and_models(start_daemon) -> None:
    base = short_tmpdir()
    (base / "vqpoold.toml").write_text(
        'budget = "8GiB"\n[models."llama"]\nreserve = "2GiB"\nlimit = "6GiB"\nweight = 2\n'
    )
    daemon = start_daemon("--config", str(base / "vqpoold.toml"))
    log = daemon.log()
    assert "budget: 8 GiB, models 'llama' (reserve 2 GiB, limit 6 GiB, weight 2)" in log
    models = daemon.admin("model_list")["models"]
    assert models[0]["model"] == "llama" and models[0]["reserve"] == 2 * 2**30
    shutil.rmtree(base, ignore_errors=True)


def test_budget_metrics_are_published(start_daemon, clients) -> None:
    daemon = budget_daemon(start_daemon, "--budget", "8000", "--metrics-port", "0")
    daemon.admin("model_set", create=True, model="a", reserve=1000, limit=6000, weight=2.0)
    a = clients(daemon, "a", 1000)
    b = clients(daemon, "b", 1000)
    assert a.allocate("a", 3)["ok"]
    assert b.allocate("b", 5)["ok"]
    b.send_allocate("b2", 2, wait=10)
    assert b.no_reply(0.1)
    samples = scrape_metrics(daemon.log())
    assert samples[("vqpool_budget_bytes", ())] == 8000
    assert samples[("vqpool_budget_free_bytes", ())] == 0
    expected = {
        "vqpool_model_reserve_bytes": (1000, 0),
        "vqpool_model_limit_bytes": (6000, 8000),
        "vqpool_model_weight": (2, 1),
        "vqpool_model_borrowed_bytes": (2000, 5000),
        "vqpool_model_waiting_requests": (0, 1),
        "vqpool_model_waiting_bytes": (0, 2000),
    }
    for name, (for_a, for_b) in expected.items():
        assert samples[(name, (("model", "a"),))] == for_a, name
        assert samples[(name, (("model", "b"),))] == for_b, name
    assert samples[("vqpool_model_bytes_held", (("model", "b"), ("stream", "k")))] == 5000


def test_a_grant_after_many_later_requests_is_still_cached_for_a_resend(
    start_daemon, clients
) -> None:
    daemon = budget_daemon(start_daemon, "--budget", "2000")
    a = clients(daemon, "a", 1000)
    b = clients(daemon, "b", 1000)
    assert a.allocate("a", 2)["ok"]
    rid = b.send_allocate("b", 1, wait=10)
    for i in range(80):  # more than the reply cache keeps per session: ids above rid evicted
        assert b.call("register_owner", {"owner": f"r{i}"})["ok"]
    b.send_allocate("b", 1, wait=10, rid=rid)  # still parked: not refused as too old
    assert b.no_reply(0.1)
    assert a.call("free_all", {"owner": "a"})["ok"]
    granted = b.recv()
    assert granted["ok"] and granted["id"] == rid
    b.send_allocate("b", 1, wait=10, rid=rid)
    assert b.recv() == granted
    assert daemon.admin("budget")["total_held"] == 1000
    daemon.audit()


def test_an_evicted_sessions_parked_allocate_is_dropped(start_daemon, clients) -> None:
    daemon = budget_daemon(start_daemon, "--budget", "2000")
    a = clients(daemon, "a", 1000)
    b = clients(daemon, "b", 1000)
    assert a.allocate("a", 2)["ok"]
    b.send_allocate("b", 1, wait=10)
    assert b.no_reply(0.1)
    daemon.admin("evict_session", sid=b.sid)
    view = daemon.admin("model_list")
    assert view["budget"]["waiting"] == 0
    assert [m["model"] for m in view["models"]] == ["a"]  # b forgotten: unconfigured, no session
    assert a.call("free_all", {"owner": "a"})["ok"]
    assert b.no_reply()
    daemon.audit()


def test_allocate_many_asks_for_its_bytes_at_once_and_credits_failed_items(
    start_daemon, clients
) -> None:
    daemon = budget_daemon(start_daemon, "--budget", "5000")
    a = clients(daemon, "a", 1000)
    b = clients(daemon, "b", 1000)
    assert b.allocate("taken", 1)["ok"]
    items = [["k", 2 * BLOCK, "x", "fp16"], ["k", BLOCK, "taken", "fp16"]]
    reply = a.call("allocate_many", {"items": items, "wait": 1.0})
    assert reply["ok"]
    assert len(reply["result"][0]) == 2
    assert reply["result"][1]["code"] == ErrorCode.OWNER_ALREADY_ACTIVE
    held = {m["model"]: m["held"] for m in daemon.admin("model_list")["models"]}
    assert held == {"a": 2000, "b": 1000}  # the failed item's 1000 bytes were credited back
    too_many = [["k", BLOCK, f"o{i}", "fp16"] for i in range(3)]  # 3000 > 2000 free
    assert error_code(a.call("allocate_many", {"items": too_many})) == ErrorCode.POOL_EXHAUSTED
    assert daemon.admin("budget")["total_held"] == 3000
    daemon.audit()


@pytest.mark.parametrize("wait", [-1, 61, "1", True])
def test_a_bad_wait_is_a_bad_request(start_daemon, clients, wait: Any) -> None:
    daemon = budget_daemon(start_daemon, "--budget", "5000")
    a = clients(daemon, "a", 1000)
    reply = a.call("allocate", {"stream": "k", "n_tokens": BLOCK, "owner": "a", "wait": wait})
    assert error_code(reply) == ErrorCode.BAD_REQUEST
    assert daemon.admin("budget")["total_held"] == 0


def test_a_budget_without_n_blocks_sizes_the_id_space(start_daemon) -> None:
    daemon = start_daemon("--budget", "64KiB")
    config = daemon.admin("stats")["config"]
    assert config["grow_on_exhaustion"] and config["max_blocks"] == 2 * 512  # the least
    assert "budget: 64 KiB" in daemon.log()


@pytest.mark.parametrize("growth", [1, "true", None])
def test_a_bad_growth_flag_is_a_bad_request(start_daemon, clients, growth: Any) -> None:
    daemon = budget_daemon(start_daemon, "--budget", "5000")
    a = clients(daemon, "a", 1000)
    args = {"stream": "k", "n_tokens": BLOCK, "owner": "a", "growth": growth}
    assert error_code(a.call("allocate", args)) == ErrorCode.BAD_REQUEST
    assert daemon.admin("budget")["total_held"] == 0


def send_growth(client: ModelClient, owner: str, wait: float) -> int:
    rid = client.next_id
    client.next_id += 1
    args = {"stream": "k", "n_tokens": BLOCK, "owner": owner, "wait": wait, "growth": True}
    client.send(client.encode("allocate", args, rid))
    return rid


def test_growths_go_ahead_of_admissions_while_owed(start_daemon, clients) -> None:
    daemon = budget_daemon(start_daemon, "--budget", "10000")
    daemon.admin("model_set", create=True, model="a", weight=2.0)  # a's share: 2/3 of the budget
    running, admitting = clients(daemon, "a", 1000), clients(daemon, "a", 1000)
    b = clients(daemon, "b", 1000)
    assert running.allocate("r", 5)["ok"]
    assert b.allocate("b1", 4)["ok"] and b.allocate("b2", 1)["ok"]  # the budget is full
    admitting.send_allocate("adm", 1, wait=10)  # a's admission parks
    assert admitting.no_reply()
    # b is above its share: its growth is refused at once, not parked.
    refused = b.call(
        "allocate", {"stream": "k", "n_tokens": BLOCK, "owner": "b1", "wait": 5, "growth": True}
    )
    assert error_code(refused) == ErrorCode.POOL_EXHAUSTED
    assert "fair share" in refused["error"]["message"]
    # a is below its share: its growth parks, ahead of its admission; a second growth of the
    # same session is answered at once.
    rid = send_growth(running, "r", wait=5)
    assert running.no_reply()
    second = running.call(
        "allocate", {"stream": "k", "n_tokens": BLOCK, "owner": "r", "wait": 5, "growth": True}
    )
    assert error_code(second) == ErrorCode.POOL_EXHAUSTED
    assert "already has a growth waiting" in second["error"]["message"]
    assert daemon.admin("budget")["waiting"] == 2
    assert b.call("free_all", {"owner": "b2"})["ok"]  # one block's bytes come free
    granted = running.recv()
    assert granted["id"] == rid and granted["ok"] and len(granted["result"]) == 1
    assert admitting.no_reply()  # the admission still waits
    assert daemon.admin("budget")["total_held"] == 10000
    daemon.audit()


KIB = 1024
HOSTILE_TOML = (
    'budget = "1MiB"\n[models."hostile"]\nlimit = "256KiB"\n[models."victim"]\nreserve = "512KiB"\n'
)
"""The issue's setting: a 1 MiB budget, model hostile limited to 256 KiB, victim's reserve 512 KiB
(64 KiB blocks: hostile may hold 4, victim is guaranteed 8)."""


def claim_error(reply: dict[str, Any]) -> dict[str, Any]:
    """The error of a claim of one owner, whether the message or the owner was refused."""
    if not reply["ok"]:
        return dict(reply["error"])
    (result,) = reply["result"]
    assert result is not None, "the claim was accepted"
    return dict(result)


def test_a_claim_outside_a_claim_period_is_refused_and_cannot_get_around_the_budget(
    start_daemon, clients
) -> None:
    base = short_tmpdir()
    (base / "vqpoold.toml").write_text(HOSTILE_TOML)
    daemon = budget_daemon(start_daemon, "--config", str(base / "vqpoold.toml"))
    shutil.rmtree(base, ignore_errors=True)
    hostile = clients(daemon, "hostile", 64 * KIB)
    victim = clients(daemon, "victim", 64 * KIB)
    assert error_code(hostile.allocate("big", 8)) == ErrorCode.OVER_BUDGET
    # 200 free k ids (12.5 MiB): no restart, no claim period: refused, nothing charged.
    error = claim_error(hostile.claim("grab", list(range(200))))
    assert error["code"] == ErrorCode.CLAIM_CONFLICT
    assert "claim period" in error["message"]
    view = daemon.admin("budget")
    assert (view["total_held"], view["over_budget"]) == (0, False)
    assert daemon.admin("owners") == []
    assert victim.allocate("mine", 1)["ok"]  # inside its reserve
    assert daemon.audit()["blocks_in_use"] == 1
    # audit lists a breach: hostile over its limit (lowered live below what it holds).
    assert hostile.allocate("small", 3)["ok"]
    daemon.admin("model_set", model="hostile", limit=128 * KIB)
    audit = daemon.admin("audit")
    assert audit["breaches"] and "'hostile'" in audit["breaches"][0], audit
    assert "limit" in audit["breaches"][0]


def test_claims_in_a_claim_period_are_checked_against_the_budget(start_daemon) -> None:
    base = short_tmpdir()
    (base / "vqpoold.toml").write_text(HOSTILE_TOML)
    options = ("--config", str(base / "vqpoold.toml"), "--lease", "30", "--claim-grace", "10")
    daemon = budget_daemon(start_daemon, *options)
    opened: list[ModelClient] = []
    try:
        before = ModelClient(daemon.run_dir, "hostile", 64 * KIB)
        opened.append(before)
        held = before.allocate("held", 2)["result"]  # the session goes on the roll
        daemon.stop(signal.SIGKILL)
        daemon = budget_daemon(start_daemon, *options, run_dir=daemon.run_dir)
        assert daemon.admin("stats")["claims"]["active"]
        # A session that resumes no session of the previous daemon takes nothing back.
        stranger = ModelClient(daemon.run_dir, "hostile", 64 * KIB, resumes=before.sid + 1)
        opened.append(stranger)
        error = claim_error(stranger.claim("grab", [100]))
        assert error["code"] == ErrorCode.CLAIM_CONFLICT and "resumes" in error["message"]
        # The resumed session: its claims are checked as allocations would be.
        again = ModelClient(daemon.run_dir, "hostile", 64 * KIB, resumes=before.sid)
        opened.append(again)
        error = claim_error(again.claim("grab", list(range(200)), done=False))
        assert error["code"] == ErrorCode.OVER_BUDGET and "limit" in error["message"]
        assert again.claim("held", held, done=False)["result"] == [None]
        error = claim_error(again.claim("more", [7, 8, 9], done=False))  # 5 x 64 KiB > 256 KiB
        assert error["code"] == ErrorCode.OVER_BUDGET
        assert again.claim("more", [7, 8])["result"] == [None]  # at its limit; done
        wait_until(lambda: not daemon.admin("stats")["claims"]["active"], timeout=3.0)
        view = daemon.admin("budget")
        assert (view["total_held"], view["over_budget"]) == (256 * KIB, False)
        victim = ModelClient(daemon.run_dir, "victim", 64 * KIB)
        opened.append(victim)
        assert victim.allocate("mine", 8)["ok"]  # its whole reserve
        audit = daemon.audit()
        assert audit["blocks_in_use"] == 12 and audit["breaches"] == []
        # After its done, even the resumed session's claims are refused.
        error = claim_error(again.claim("late", [20]))
        assert error["code"] == ErrorCode.CLAIM_CONFLICT and "claim period" in error["message"]
    finally:
        for client in opened:
            client.close()
        shutil.rmtree(base, ignore_errors=True)


def test_a_session_over_its_waiting_bound_is_refused_and_another_still_waits(
    start_daemon, clients
) -> None:
    daemon = budget_daemon(start_daemon, "--budget", str(8 * 10**6))
    holder = clients(daemon, "holder", 100_000)
    assert holder.allocate("h", 80)["ok"]  # the budget is full: every other request waits
    hostile = clients(daemon, "hostile", 1000)
    # 4,096 items with 128-character owners keep about 1.6 MB each while they wait: two fit
    # a session's bound (4 MiB), a third does not.
    for n in range(2):
        items = [["k", BLOCK, f"{n}-{i}-".ljust(128, "x"), "fp16"] for i in range(4096)]
        hostile.send(hostile.encode("allocate_many", {"items": items, "wait": 20.0}))
    wait_until(lambda: daemon.admin("budget")["waiting"] == 2, 5.0)
    items = [["k", BLOCK, f"2-{i}-".ljust(128, "x"), "fp16"] for i in range(4096)]
    refused = hostile.call("allocate_many", {"items": items, "wait": 20.0})
    assert error_code(refused) == ErrorCode.POOL_EXHAUSTED
    assert "this session's waiting requests would keep" in refused["error"]["message"]
    assert daemon.admin("budget")["waiting"] == 2  # the refusal changed nothing
    victim = clients(daemon, "victim", 1000)
    victim.send_allocate("v", 1, wait=20.0)
    wait_until(lambda: daemon.admin("budget")["waiting"] == 3, 5.0)  # queued, not refused
    assert victim.no_reply()
    assert holder.call("free_all", {"owner": "h"})["ok"]  # bytes for everyone waiting
    assert victim.recv()["ok"]
    daemon.audit()


def test_one_process_cannot_fill_the_waiting_cap_for_everybody(
    start_daemon, clients, start_worker
) -> None:
    daemon = budget_daemon(start_daemon, "--budget", str(8 * 10**6))
    holder = clients(daemon, "holder", 100_000)
    assert holder.allocate("h", 80)["ok"]  # the budget is full: every other request waits
    # One process (this one), four sessions under four model names: 256 waiting requests,
    # the most one process may have.
    sessions = [clients(daemon, f"name-{m}", 1000) for m in range(4)]
    for m, session in enumerate(sessions):
        for i in range(64):
            session.send_allocate(f"{m}-{i}", 1, wait=20.0)
    wait_until(lambda: daemon.admin("budget")["waiting"] == 256, 5.0)
    fifth = clients(daemon, "name-4", 1000)
    refused = fifth.allocate("more", 1, wait=20.0)
    assert error_code(refused) == ErrorCode.POOL_EXHAUSTED
    assert "requests waiting, the most one process may" in refused["error"]["message"]
    # Another process's request still waits its turn (answered when its wait ends).
    other = start_worker(daemon.run_dir, "other")
    with pytest.raises(AgentError) as waited:
        other.call("allocate", "k", BLOCK, "o", "fp16", 0.3)
    assert re.search(r"allocate: waited [0-9.e-]+s for", str(waited.value))  # it was queued
    daemon.audit()


def test_a_waiting_request_is_granted_when_a_free_and_a_refused_try_share_a_loop_turn(
    start_daemon, clients
) -> None:
    daemon = budget_daemon(start_daemon, "--budget", "100000")
    daemon.admin("model_set", model="c", weight=8, create=True)
    a = clients(daemon, "a", 1000)
    b = clients(daemon, "b", 1000)
    c = clients(daemon, "c", 1000)
    assert a.allocate("a1", 70)["ok"] and a.allocate("a2", 20)["ok"]  # 10 blocks' bytes free
    b.send_allocate("b1", 20, wait=6.0)
    wait_until(lambda: daemon.admin("budget")["waiting"] == 1, 5.0)
    # The free and c's wait-0 try, held until the daemon reads them together: c is first in
    # the policy order and does not fit, b's 20 do once a's are freed.
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        a.send(a.encode("free_all", {"owner": "a2"}))
        c.send_allocate("c1", 80, wait=0.0)
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    assert a.recv()["ok"]
    assert error_code(c.recv()) == ErrorCode.POOL_EXHAUSTED
    reply = b.recv(timeout=3.0)  # granted now, not refused when its 6 s are over
    assert reply["ok"], reply
    daemon.audit()
