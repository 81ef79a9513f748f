"""A request whose client leaves while it waits at the daemon does not hold up its model: the
worker cancels the waiting allocation (the ``cancel`` worker op), so the model's next request is
served at once when its bytes are free, not when the wait of the abandoned one runs out."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from serving_harness import ServingStack
from vqpool.worker import PoolClient

LLAMA = "builtin:llama"
BLOCK_BYTES = 4096  # builtin:llama, per stream and block of 16 slots
KIB = 1024
LIMIT = 256 * KIB  # llama's limit; the budget (2 MiB) has far more free
AHEAD_BLOCKS = 24  # per stream: 192 KiB of llama's limit held by the request ahead
PROMPT = "budget: " + "x" * 32  # 40 bytes (tokens)

log = logging.getLogger(__name__)


@pytest.fixture
def stack() -> Iterator[ServingStack]:
    serving = ServingStack(
        [LLAMA],
        daemon_args=("--budget", "2MiB", "--lease", "1"),
        # A queue head may wait up to 60 s at the daemon; "full" reserves prompt + max_tokens.
        worker_args=[
            "--max-concurrent",
            "2",
            "--queue-timeout",
            "60",
            "--reserve",
            "full",
            "--prompt-cache-bytes",
            "0",
        ],
    ).start()
    serving.daemon.admin("model_set", model=LLAMA, limit=LIMIT)
    yield serving
    serving.stop()


def llama_view(stack: ServingStack) -> dict[str, Any]:
    views = stack.daemon.admin("model_list")["models"]
    return next(v for v in views if v["model"] == LLAMA)


def wait_for(condition: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_request_behind_an_abandoned_waiting_one_is_served_while_the_one_ahead_runs(
    stack: ServingStack,
) -> None:
    cancelled_before = stack.worker_stats(LLAMA)["ended_cancelled"]
    # The long request ahead: llama bytes held (192 KiB of its 256 KiB limit) until we end it.
    with PoolClient(stack.run_dir, name=LLAMA, bytes_per_block=BLOCK_BYTES) as ahead:
        for stream in ("k", "v"):
            ahead.allocate(stream, AHEAD_BLOCKS * ahead.config.block_size, "ahead")
        # 40 + 150 slots: 12 blocks per stream (96 KiB), over the 64 KiB left of the limit.
        body = b'{"prompt": "%s", "max_tokens": 150}' % PROMPT.encode()
        client = stack.send_request(LLAMA, body)
        wait_for(lambda: llama_view(stack)["waiting"] == 1, "the request never waited")
        client.close()  # gone while its request waits at the daemon
        left_at = time.monotonic()
        wait_for(
            lambda: stack.worker_stats(LLAMA)["ended_cancelled"] > cancelled_before,
            "the worker never saw its client leave",
        )
        # The abandoned allocation leaves the model's queue: nothing waits any more.
        wait_for(
            lambda: llama_view(stack)["waiting"] == 0,
            "the abandoned allocation still waits at the head of llama's queue",
        )
        # 40 + 5 slots: 3 blocks per stream (24 KiB), within what the limit has left.
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(stack.complete, LLAMA, {"prompt": PROMPT, "max_tokens": 5})
            # Served while the request ahead still holds its bytes (it ends only below).
            reply = pending.result(timeout=20)
        log.warning("figures: served %.2f s after its client left", time.monotonic() - left_at)
        assert reply.status == 200, reply
        assert reply.body["usage"]["completion_tokens"] == 5
        assert stack.daemon.admin("stats")["budget"]["total_held"] >= 2 * AHEAD_BLOCKS * BLOCK_BYTES
        ahead.free_all("ahead")
    stack.wait_for_no_blocks()
