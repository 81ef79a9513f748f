"""Requests that end badly still give their blocks back: a client that disconnects mid-stream,
a worker killed mid-request (the daemon reclaims its blocks while the other worker serves on)."""

from __future__ import annotations

import contextlib
import http.client
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from daemon_harness import wait_until
from serving_harness import ServingStack
from vqpool.worker.testing.http_client import stream_events

LLAMA = "builtin:llama"
QWEN2 = "builtin:qwen2"
LONG = {"prompt": "a long answer, please: ", "max_tokens": 3000}


@pytest.fixture(scope="module")
def stack() -> Iterator[ServingStack]:
    serving = ServingStack([LLAMA, QWEN2]).start()
    yield serving
    serving.stop()


def test_client_disconnecting_mid_stream_frees_its_blocks(stack: ServingStack) -> None:
    events = stream_events(stack.url(LLAMA), "/v1/completions", LONG)
    for _ in range(5):
        next(events)
    assert stack.blocks_by_model().get(LLAMA, 0) > 0
    events.close()  # closes the connection mid-stream
    # The worker stores the ended row in its prompt cache before it counts the end: wait for
    # the count, so that the cache drop below cannot come before the store.
    wait_until(lambda: stack.worker_stats(LLAMA)["ended_cancelled"] == 1, timeout=5)
    stack.wait_for_no_blocks(timeout=5)
    stats = stack.worker_stats(LLAMA)
    assert stats["ended_cancelled"] == 1 and stats["blocks"] == 0 and stats["active"] == 0
    reply = stack.complete(LLAMA, {"prompt": "after the disconnect", "max_tokens": 5})
    assert reply.status == 200


def test_killed_worker_has_its_blocks_reclaimed_while_the_other_serves(
    stack: ServingStack,
) -> None:
    victim = stack.workers[QWEN2]
    events = stream_events(victim.url, "/v1/completions", LONG)
    for _ in range(3):
        next(events)
    with ThreadPoolExecutor(1) as pool:
        survivor = pool.submit(stack.complete, LLAMA, {"prompt": "keep going", "max_tokens": 200})
        wait_until(lambda: stack.blocks_by_model().get(LLAMA, 0) > 0, timeout=10)
        assert stack.blocks_by_model()[QWEN2] > 0
        victim.stop(signal.SIGKILL)
        # The stream ends without [DONE] (EOF or a reset, whichever the OS reports).
        with contextlib.suppress(OSError, http.client.HTTPException):
            for event in events:
                assert event["choices"][0]["finish_reason"] is None
        started = time.monotonic()
        wait_until(lambda: QWEN2 not in stack.blocks_by_model(), timeout=5)
        reclaimed_in = time.monotonic() - started
        reply = survivor.result(timeout=30)
    assert reply.status == 200 and reply.body["usage"]["completion_tokens"] == 200
    assert reclaimed_in < 5
    stack.daemon.audit()
    assert not [o for o in stack.daemon.admin("owners") if o["model"] == QWEN2]
    after = stack.complete(LLAMA, {"prompt": "still here", "max_tokens": 5})
    assert after.status == 200
    stack.wait_for_no_blocks()
