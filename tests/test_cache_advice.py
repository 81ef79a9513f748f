"""The daemon's advice to a worker's prompt cache (the answer to its load report): it asks for
cached bytes only when giving them back would let a waiting allocation be granted. A request
blocked by its own model's limit while the budget has bytes free cannot be helped by another
model's cache; a request short of budget bytes can, by what it lacks; and so can a request
refused because the pool's block ids ran out while the budget had room."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from daemon_harness import wait_until
from serving_harness import ServingStack
from test_daemon_budget import ModelClient, budget_daemon, clients
from vqpool.worker.testing.http_client import request_json
from vqpool.worker.testing.launch import DaemonProcess

__all__ = ["clients"]  # the fixture, shared with test_daemon_budget

BLOCK_BYTES = 1000
CACHED = 5 * BLOCK_BYTES


def advice(client: ModelClient, cached: int = CACHED) -> Any:
    """The answer to a load report saying the client's prompt cache holds ``cached`` bytes."""
    reply = client.call("ping", {"prompt_cache": {"bytes": cached, "entries": 1}})
    assert reply["ok"], reply
    return reply["result"]


def park(client: ModelClient, owner: str, n_blocks: int) -> None:
    client.send_allocate(owner, n_blocks, wait=30)
    assert client.no_reply(0.1)


def test_a_model_waiting_at_its_own_limit_asks_no_other_models_cache(
    start_daemon: Callable[..., DaemonProcess], clients: Callable[..., ModelClient]
) -> None:
    daemon = budget_daemon(start_daemon, "--budget", "100000")  # 100 blocks' worth
    daemon.admin("model_set", model="a", limit=4 * BLOCK_BYTES, create=True)
    a = clients(daemon, "a", BLOCK_BYTES)
    b = clients(daemon, "b", BLOCK_BYTES)
    assert a.allocate("a-1", 4)["ok"]  # a at its limit
    assert advice(b) is None  # nothing waits
    park(a, "a-2", 2)  # waits for a's own bytes; the budget has 96 blocks free
    assert daemon.admin("budget")["waiting"] == 1
    assert advice(b) is None  # b's cache cannot help a: it keeps its entries
    # A's own caches are a's bytes, and give a what it lacks.
    assert advice(a) == {"release_bytes": 2 * BLOCK_BYTES}
    a2 = clients(daemon, "a", BLOCK_BYTES)
    assert advice(a2) == {"release_bytes": 2 * BLOCK_BYTES}
    assert advice(a2, cached=0) is None  # nothing cached, nothing asked
    # Its limit lowered below what it holds: what it holds above it counts too.
    daemon.admin("model_set", model="a", limit=3 * BLOCK_BYTES)
    assert advice(a) == {"release_bytes": 3 * BLOCK_BYTES}
    assert advice(b) is None


def test_a_model_short_of_budget_bytes_asks_for_what_it_lacks(
    start_daemon: Callable[..., DaemonProcess], clients: Callable[..., ModelClient]
) -> None:
    daemon = budget_daemon(start_daemon, "--budget", "10000")  # 10 blocks' worth
    a = clients(daemon, "a", BLOCK_BYTES)
    b = clients(daemon, "b", BLOCK_BYTES)
    assert b.allocate("b-1", 8)["ok"]  # b's prompt cache, say: 2 blocks stay free
    park(a, "a-1", 5)  # lacks 3 blocks
    assert advice(b) == {"release_bytes": 3 * BLOCK_BYTES}
    assert advice(a) == {"release_bytes": 3 * BLOCK_BYTES}  # its own cache goes first too
    assert b.call("free_all", {"owner": "b-1"})["ok"]
    granted = a.recv()
    assert granted["ok"], granted
    assert advice(b) is None
    daemon.audit()


def test_a_request_short_of_ids_gets_another_models_cached_blocks() -> None:
    # 32 ids per stream and no budget: ids run out long before bytes would. A short queue
    # timeout makes a request the cache advice fails to serve a fast 503.
    stack = ServingStack(
        ["builtin:llama", "builtin:qwen3"],
        daemon_args=("--n-blocks", "64", "--lease", "1"),
        worker_args=("--queue-timeout", "5"),
    ).start()
    try:

        def session(model: str) -> dict[str, Any]:
            (row,) = [s for s in stack.daemon.admin("sessions") if s["model"] == model]
            return row

        def ask(model: str, n_prompt: int) -> None:
            body = {"model": model, "prompt": [i % 200 for i in range(n_prompt)], "max_tokens": 4}
            reply = request_json(stack.url(model), "POST", "/v1/completions", body)
            assert reply.status == 200, (reply, stack.logs())

        ask("builtin:llama", 400)  # 404 tokens: 26 of the 32 ids of each stream

        def idle_with_its_cache() -> bool:  # as the worker's next load report tells it
            row = session("builtin:llama")
            cached = bool(row["prompt_cache"] and row["prompt_cache"]["bytes"])
            return row["running"] == 0 and row["n_blocks"] == 2 * 26 and cached

        wait_until(idle_with_its_cache, timeout=5)
        free = {s: row["free"] for s, row in stack.pool_streams().items()}
        assert free == {"k": 6, "v": 6}, free
        ask("builtin:qwen3", 150)  # 10 blocks of each stream: only the cache's ids serve it
        assert session("builtin:llama")["n_blocks"] < 2 * 26
        assert stack.worker_stats("builtin:llama")["prompt_cache"]["evictions"] >= 1
        stack.wait_for_no_blocks()
    finally:
        stack.stop()
