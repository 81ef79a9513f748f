"""Cooperative reclaim in a real vqpoold with real worker processes (issue 13): a model's reserve
lent to another model comes back through the borrower's reclaim handler within the deadline; a
worker that ignores the ask is counted late and nothing breaks; a budget lowered below holdings
asks the same way. Workers are tests/worker_agent.py processes (PoolClient, 4 KiB per block)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from ctl_harness import run_ctl
from daemon_harness import AgentError, AgentProcess, RawClient, scrape_metrics, wait_until
from vqpool.worker.testing.launch import DaemonProcess

BLOCK = 16  # tokens per block (the daemon's default)
BYTES_PER_BLOCK = 4096  # worker_agent's declared bytes per block
BUDGET_BLOCKS = 64


def lending_daemon(start: Callable[..., DaemonProcess], *args: str) -> DaemonProcess:
    daemon = start(
        "--n-blocks",
        "512",
        "--lease",
        "2",
        "--budget",
        str(BUDGET_BLOCKS * BYTES_PER_BLOCK),
        "--lend-reserves",
        *args,
    )
    daemon.admin("model_set", create=True, model="a", reserve=32 * BYTES_PER_BLOCK)
    return daemon


def fill_on_loan(worker: AgentProcess, n_owners: int, blocks_each: int) -> None:
    for i in range(n_owners):
        worker.call("allocate", "k", blocks_each * BLOCK, f"{worker.name}-{i}")


def stubborn_on_loan(
    daemon: DaemonProcess, start_worker: Callable[[Path, str], AgentProcess]
) -> AgentProcess:
    """A worker of model c that polls for asks but never gives back, holding 60 of 64 blocks
    (28 of a's 32-block reserve on loan)."""
    stubborn = start_worker(daemon.run_dir, "c")
    stubborn.call("reclaim_handler", "stall")
    fill_on_loan(stubborn, 6, 10)
    return stubborn


def reclaim_view(daemon: DaemonProcess) -> dict:
    return daemon.admin("budget")["reclaim"]


def test_a_lent_reserve_comes_back_by_reclaim_within_the_deadline(
    start_daemon: Callable[..., DaemonProcess],
    start_worker: Callable[[Path, str], AgentProcess],
) -> None:
    daemon = lending_daemon(start_daemon, "--metrics-port", "0")
    borrower = start_worker(daemon.run_dir, "b")
    assert reclaim_view(daemon)["listening_sessions"] == 0
    borrower.call("reclaim_handler", "free")
    # Its first poll is what tells the daemon it can be asked.
    wait_until(lambda: reclaim_view(daemon)["listening_sessions"] == 1, 5.0)
    fill_on_loan(borrower, 6, 10)  # 60 of 64 blocks: 28 of a's 32-block reserve on loan
    budget = daemon.admin("budget")
    assert budget["lent"] == 28 * BYTES_PER_BLOCK
    owner_a = start_worker(daemon.run_dir, "a")
    # 20 blocks, within a's reserve; 4 are free: the daemon asks b for 16 and a waits for them.
    blocks = owner_a.call("allocate", "k", 20 * BLOCK, "a-0", "fp16", 5.0)
    assert len(blocks) == 20
    # a is granted as b frees; b's answer follows its frees.
    wait_until(lambda: reclaim_view(daemon)["answered"] == 1, 5.0)
    view = reclaim_view(daemon)
    assert (view["asked"], view["answered"], view["late"]) == (1, 1, 0), view
    assert view["bytes_reclaimed"] >= 16 * BYTES_PER_BLOCK
    assert view["latency_p99_s"] is not None and view["latency_p99_s"] <= view["deadline_s"]
    assert borrower.call("reclaim_asks") == [16 * BYTES_PER_BLOCK]
    # b gave back whole owners, newest first: 2 of 10 blocks; it keeps 40.
    assert borrower.call("held_bytes") == 40 * BYTES_PER_BLOCK
    models = {m["model"]: m for m in daemon.admin("model_list")["models"]}
    assert models["a"]["held"] == 20 * BYTES_PER_BLOCK
    assert models["b"]["held"] == 40 * BYTES_PER_BLOCK
    ids_a = set(blocks)
    ids_b = {row[0] for i in range(4) for row in borrower.call("blocks_for", f"b-{i}")}
    assert not ids_a & ids_b, "a block held by two owners"
    daemon.audit()
    borrower.call("report_load", 4, 0, 3)
    wait_until(lambda: reclaim_view(daemon)["preemptions"] == 3, 5.0)
    status = run_ctl(daemon.run_dir, "status")
    assert status.returncode == 0, status.stderr
    assert "reclaim: asked 1, answered 1 (answer p50 " in status.stdout
    assert ", late 0, given back 80 KiB; preemptions 3" in status.stdout
    samples = scrape(daemon)
    for outcome, value in (("asked", 1), ("answered", 1), ("late", 0)):
        assert samples[("vqpool_reclaim_asks_total", (("outcome", outcome),))] == value
    assert samples[("vqpool_reclaim_bytes_total", ())] == 20 * BYTES_PER_BLOCK
    assert samples[("vqpool_preemptions_total", ())] == 3
    assert ("vqpool_reclaim_latency_seconds", (("quantile", "0.99"),)) in samples
    # a holds 20 of its 32; 4 blocks are free: 8 of its unused 12 are still on loan to b.
    assert samples[("vqpool_model_lent_bytes", (("model", "a"),))] == 8 * BYTES_PER_BLOCK
    borrower.stop()  # its session ends: nobody can be asked any more
    wait_until(lambda: reclaim_view(daemon)["listening_sessions"] == 0, 5.0)


def scrape(daemon: DaemonProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return scrape_metrics(daemon.log())


def test_a_worker_that_ignores_the_ask_is_counted_late_and_nothing_breaks(
    start_daemon: Callable[..., DaemonProcess],
    start_worker: Callable[[Path, str], AgentProcess],
) -> None:
    daemon = lending_daemon(start_daemon, "--reclaim-deadline", "0.5")
    stubborn = stubborn_on_loan(daemon, start_worker)
    owner_a = start_worker(daemon.run_dir, "a")
    with pytest.raises(AgentError) as refused:
        owner_a.call("allocate", "k", 20 * BLOCK, "a-0", "fp16", 1.5)
    assert refused.value.kind == "BlockPoolExhaustedError"
    wait_until(lambda: reclaim_view(daemon)["late"] >= 1, 5.0)
    assert "did not give back" in daemon.log()
    # The stubborn worker is alive and served; once its requests end, a is served at once.
    assert stubborn.call("held_bytes") == 60 * BYTES_PER_BLOCK
    for i in range(2):
        stubborn.call("free_all", f"c-{i}")
    assert len(owner_a.call("allocate", "k", 20 * BLOCK, "a-0", "fp16", 1.0)) == 20
    stubborn.call("ping")
    daemon.audit()


def test_a_budget_lowered_below_holdings_is_met_by_reclaim(
    start_daemon: Callable[..., DaemonProcess],
    start_worker: Callable[[Path, str], AgentProcess],
) -> None:
    daemon = lending_daemon(start_daemon)
    borrower = start_worker(daemon.run_dir, "b")
    borrower.call("reclaim_handler", "free")
    fill_on_loan(borrower, 6, 10)
    daemon.admin("budget", bytes=40 * BYTES_PER_BLOCK)  # a's 32-block reserve still fits
    wait_until(lambda: reclaim_view(daemon)["answered"] >= 1, 5.0)
    budget = daemon.admin("budget")
    assert budget["total_held"] <= 40 * BYTES_PER_BLOCK and not budget["over_budget"]
    daemon.audit()


def test_reclaim_answers_are_checked_against_the_ledger(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    daemon = lending_daemon(start_daemon)
    raw = RawClient(daemon.run_dir)
    try:
        hello = {"pid": os.getpid(), "model": "b", "nonce": "n1", "bytes_per_block": 4096}
        reply = raw.call("hello", hello)
        assert reply["ok"], reply
        raw.sid, raw.boot = reply["result"]["sid"], reply["result"]["boot"]
        # No open ask: a bogus answer counts nothing and changes nothing.
        reply = raw.call("reclaim_done", {"ask": 7, "freed": 1 << 40})
        assert reply["ok"] and reply["result"] == {"accepted": False, "freed": 0}
        assert raw.call("reclaim_done", {"ask": 7, "freed": -1})["ok"] is False
        assert raw.call("reclaim_poll", {"wait": 31.0})["ok"] is False
        reply = raw.call("reclaim_poll", {"wait": 0.0})
        assert reply["ok"] and reply["result"] == {"ask": None}
        reply = raw.call("reclaim_poll", {"wait": 0.2})  # parked, answered when its wait ends
        assert reply["ok"] and reply["result"] == {"ask": None}
        view = reclaim_view(daemon)
        assert (view["stale_answers"], view["bytes_reclaimed"]) == (1, 0)
    finally:
        raw.close()
    daemon.audit()


def test_preemptions_are_counted_once_across_a_reopened_session(
    start_daemon: Callable[..., DaemonProcess],
    start_worker: Callable[[Path, str], AgentProcess],
) -> None:
    daemon = lending_daemon(start_daemon)
    worker = start_worker(daemon.run_dir, "b")
    worker.call("report_load", 1, 0, 3)
    wait_until(lambda: reclaim_view(daemon)["preemptions"] == 3, 5.0)
    sid = worker.call("session")["sid"]
    daemon.admin("evict_session", sid=sid)
    wait_until(lambda: worker.call("session")["sid"] != sid, 5.0)  # the heartbeat reopens
    worker.call("report_load", 1, 0, 5)  # 2 more since
    wait_until(lambda: reclaim_view(daemon)["preemptions"] >= 5, 5.0)
    worker.call("ping")
    assert reclaim_view(daemon)["preemptions"] == 5


def test_the_loop_plans_reclaim_only_when_something_changed(
    start_daemon: Callable[..., DaemonProcess],
    start_worker: Callable[[Path, str], AgentProcess],
) -> None:
    daemon = lending_daemon(start_daemon, "--reclaim-deadline", "30")
    stubborn = stubborn_on_loan(daemon, start_worker)
    raw = RawClient(daemon.run_dir)
    try:
        hello = {"pid": os.getpid(), "model": "a", "nonce": os.urandom(8).hex()}
        reply = raw.call("hello", {**hello, "bytes_per_block": BYTES_PER_BLOCK})
        raw.sid, raw.boot = reply["result"]["sid"], reply["result"]["boot"]
        args = {"stream": "k", "n_tokens": 20 * BLOCK, "owner": "a-0", "wait": 20.0}
        raw.send(raw.encode("allocate", args))  # waits for a's reserve, lent to c
        wait_until(lambda: reclaim_view(daemon)["asked"] == 1, 5.0)  # c is asked, stalls
        plans = reclaim_view(daemon)["plans"]
        assert plans >= 1
        # Nothing changes while a waits: loop turns (admin pings, and the time they take,
        # many times the 5 ms between two plans) plan nothing more.
        for _ in range(100):
            daemon.admin("ping")
        assert daemon.admin("budget")["waiting"] == 1
        assert reclaim_view(daemon)["plans"] == plans
        # A change (c frees 10 blocks, still short of a's 20) is planned for once more.
        stubborn.call("free_all", "c-0")
        wait_until(lambda: reclaim_view(daemon)["plans"] > plans, 5.0)
    finally:
        raw.close()
    daemon.audit()
