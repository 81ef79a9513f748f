"""``vqpoolctl fit`` counts a model's own idle prompt cache as memory it could get now: the
cache's blocks are ended requests' KV, which the model's workers give back before a request of
theirs waits. The answer says how much of "now" is that cache (``own_cache_now``, a field added
beside the old ones). A real daemon; raw sessions report their cache in a ping, as workers do."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from ctl_harness import run_ctl
from test_daemon_budget import ModelClient, budget_daemon, clients
from vqpool.shared.byte_sizes import format_bytes
from vqpool.worker.testing.launch import DaemonProcess

__all__ = ["clients"]  # the fixture, shared with test_daemon_budget

BLOCK_BYTES = 1000


def report_cache(client: ModelClient, n_bytes: int) -> None:
    reply = client.call(
        "ping", {"prompt_cache": {"bytes": n_bytes, "blocks": n_bytes // BLOCK_BYTES}}
    )
    assert reply["ok"], reply


Pool = tuple[DaemonProcess, ModelClient, ModelClient]


@pytest.fixture
def pool(start_daemon: Callable[..., DaemonProcess], clients: Callable[..., ModelClient]) -> Pool:
    """A daemon with a budget of 20 blocks' worth, and a session of models a and b."""
    daemon = budget_daemon(start_daemon, "--budget", "20000")
    return daemon, clients(daemon, "a", BLOCK_BYTES), clients(daemon, "b", BLOCK_BYTES)


def test_fit_counts_the_models_own_prompt_cache_as_available_now(pool: Pool) -> None:
    daemon, a, b = pool
    assert a.allocate("a-cache", 16)["ok"]  # 16000 bytes, 15000 of them a's idle prompt cache
    assert b.allocate("b-1", 2)["ok"]  # 2000 free in all
    report_cache(a, 15 * BLOCK_BYTES)
    # Eight sequences of one block per stream: 16000 bytes, which a has once its cache goes.
    result = run_ctl(
        daemon.run_dir, "fit", "--model", "a", "--context", "16", "--concurrency", "8", "--json"
    )
    answer = json.loads(result.stdout)
    per_sequence = answer["bytes_per_sequence"]
    assert answer["held"] == 16000
    # Without its cache: the 2000 free bytes; with it, a's own 15000 on top.
    assert answer["available_now"] == 17000
    assert answer["own_cache_now"] == 15000
    assert answer["max_concurrency_now"] == 17000 // per_sequence
    assert answer["verdict"] == "now" and result.returncode == 0, answer
    text = run_ctl(daemon.run_dir, "fit", "--model", "a", "--context", "16", "--concurrency", "8")
    assert text.returncode == 0, text.stderr
    assert (
        f"could get {format_bytes(17000)} now ({format_bytes(15000)} of it its own idle "
        "prompt cache)"
    ) in text.stdout
    # Another model's cache is not the asking model's to take: b's answer is unchanged.
    answer_b = json.loads(
        run_ctl(daemon.run_dir, "fit", "--model", "b", "--context", "16", "--json").stdout
    )
    assert answer_b["available_now"] == 2000 and answer_b["own_cache_now"] == 0


def test_fit_without_a_cache_report_says_no_own_cache(pool: Pool) -> None:
    daemon, a, _ = pool
    assert a.allocate("a-1", 4)["ok"]
    result = run_ctl(daemon.run_dir, "fit", "--model", "a", "--context", "16")
    assert result.returncode == 0, result.stderr
    assert "prompt cache" not in result.stdout
    answer = json.loads(
        run_ctl(daemon.run_dir, "fit", "--model", "a", "--context", "16", "--json").stdout
    )
    assert answer["available_now"] == 16000 and answer["own_cache_now"] == 0
