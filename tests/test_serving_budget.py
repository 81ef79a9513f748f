"""vqpool-worker on a daemon with a byte budget: the queue head waits at the daemon (parked in
its model's fair queue, not polling), a client that goes away while its request is parked gets
no blocks kept for it, and a request that can never fit the budget gets HTTP 400 at once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from serving_harness import ServingStack, builtin_weights
from vqpool.worker import PoolClient

LLAMA = "builtin:llama"
BLOCK_BYTES = 4096  # builtin:llama, per stream and block of 16 slots
BUDGET_BLOCKS = 64  # 32 K + 32 V blocks
BUDGET = BUDGET_BLOCKS * BLOCK_BYTES + builtin_weights(LLAMA)  # the KV beside llama's weights
PROMPT = "budget: " + "x" * 32  # 40 bytes; with 20 new tokens 4 blocks per stream


@pytest.fixture(scope="module")
def stack() -> Iterator[ServingStack]:
    serving = ServingStack(
        [LLAMA],
        daemon_args=("--budget", f"{BUDGET}B", "--lease", "1"),
        worker_args=["--max-concurrent", "2", "--queue-timeout", "30"],
    ).start()
    yield serving
    serving.stop()


def hog_the_budget(stack: ServingStack) -> PoolClient:
    """Another model's session holding the whole budget."""
    hog = PoolClient(stack.run_dir, name="hog", bytes_per_block=BLOCK_BYTES)
    for stream in ("k", "v"):
        hog.allocate(stream, BUDGET_BLOCKS // 2 * hog.config.block_size, "hog-request")
    return hog


def llama_view(stack: ServingStack) -> dict[str, Any]:
    views = stack.daemon.admin("model_list")["models"]
    return next(v for v in views if v["model"] == LLAMA)


def wait_parked(stack: ServingStack) -> None:
    deadline = time.monotonic() + 10
    while llama_view(stack)["waiting"] != 1:
        assert time.monotonic() < deadline, "the request never waited at the daemon"
        time.sleep(0.02)


def test_the_queue_head_waits_at_the_daemon_until_bytes_are_freed(stack: ServingStack) -> None:
    with hog_the_budget(stack) as hog, ThreadPoolExecutor(1) as pool:
        pending = pool.submit(stack.complete, LLAMA, {"prompt": PROMPT, "max_tokens": 20})
        wait_parked(stack)  # one request parked in the daemon's queue, not polling
        stats = stack.worker_stats(LLAMA)
        assert stats["waiting_for_blocks"] and stats["queue_length"] == 1
        assert not pending.done()
        hog.free_all("hog-request")
        reply = pending.result(timeout=30)
    assert reply.status == 200 and reply.body["usage"]["completion_tokens"] == 20
    assert llama_view(stack)["waiting"] == 0
    stack.wait_for_no_blocks()


def test_a_request_whose_client_left_while_parked_keeps_no_blocks(stack: ServingStack) -> None:
    cancelled_before = stack.worker_stats(LLAMA)["ended_cancelled"]
    with hog_the_budget(stack) as hog:
        body = b'{"prompt": "%s", "max_tokens": 20}' % PROMPT.encode()
        client = stack.send_request(LLAMA, body)
        wait_parked(stack)
        client.close()  # gone while its request waits at the daemon
        deadline = time.monotonic() + 10
        while stack.worker_stats(LLAMA)["ended_cancelled"] == cancelled_before:
            assert time.monotonic() < deadline, "the worker never saw its client leave"
            time.sleep(0.02)
        hog.free_all("hog-request")  # the daemon may now grant the parked request
    stack.wait_for_no_blocks()
    assert stack.worker_stats(LLAMA)["blocks"] == 0
    reply = stack.complete(LLAMA, {"prompt": PROMPT, "max_tokens": 5})
    assert reply.status == 200


def test_a_request_that_can_never_fit_gets_400_at_once(stack: ServingStack) -> None:
    # 40 + 1000 tokens: 65 blocks per stream, over the 32 the budget has for one stream.
    started = time.monotonic()
    reply = stack.complete(LLAMA, {"prompt": PROMPT, "max_tokens": 1000})
    assert time.monotonic() - started < 10
    assert reply.status == 400, reply
    message = reply.body["error"]["message"]
    assert "never fit" in message and "1040 tokens" in message
    assert str(BUDGET_BLOCKS * BLOCK_BYTES) in message
    assert stack.worker_stats(LLAMA)["queue_length"] == 0
