"""A worker whose vqpoold is gone: requests that cannot start are refused at once with a 503
naming the daemon, requests already running finish on the blocks they hold, and what they free
meanwhile is settled when the daemon answers again (or dropped by a restarted one)."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from daemon_harness import wait_until
from serving_harness import ServingStack
from vqpool.worker.testing.http_client import request_json, stream_events

LLAMA = "builtin:llama"
POOL_TIMEOUT = 2.0  # seconds a daemon call may take: how long a running request waits for it


def start_stack(pool_timeout: float | None) -> ServingStack:
    worker_args = () if pool_timeout is None else ("--pool-timeout", str(pool_timeout))
    return ServingStack(
        [LLAMA], daemon_args=("--n-blocks", "512", "--lease", "1"), worker_args=worker_args
    ).start()


@pytest.fixture
def stack() -> Iterator[ServingStack]:
    serving = start_stack(POOL_TIMEOUT)
    yield serving
    serving.stop()


@pytest.fixture
def stack_with_default_pool_timeout() -> Iterator[ServingStack]:
    serving = start_stack(None)  # 10 s: each daemon call a new request made waited that long
    yield serving
    serving.stop()


def health(stack: ServingStack) -> str:
    reply = request_json(stack.url(LLAMA), "GET", "/health", timeout=10)
    return str(reply.body["status"])


def stream_while(stack: ServingStack, during: Any) -> list[dict[str, Any]]:
    """Stream a long request; once its first tokens came, call ``during()``; every event."""
    events: list[dict[str, Any]] = []
    body = {"prompt": "a running request: ", "max_tokens": 30000, "return_token_ids": True}
    for event in stream_events(stack.url(LLAMA), "/v1/completions", body, timeout=60):
        events.append(event)
        if len(events) == 1:
            during()
    return events


def test_with_the_daemon_down_a_new_request_gets_503_naming_it_at_once(
    stack_with_default_pool_timeout: ServingStack,
) -> None:
    stack = stack_with_default_pool_timeout
    stack.daemon.process.kill()  # SIGKILL, not restarted
    wait_until(lambda: health(stack) == "no_session", timeout=10)
    started = time.monotonic()
    reply = stack.complete(LLAMA, {"prompt": "a new request", "max_tokens": 8})
    elapsed = time.monotonic() - started
    assert reply.status == 503, reply
    assert elapsed < 5.0, elapsed
    assert int(reply.headers["retry-after"]) >= 1
    message = reply.body["error"]["message"]
    assert "vqpoold" in message and str(stack.run_dir) in message and "\n" not in message


def test_a_request_running_when_the_daemon_dies_finishes_on_its_blocks(
    stack: ServingStack,
) -> None:
    events = stream_while(stack, stack.daemon.process.kill)
    done = [e for e in events if e.get("choices")]
    assert not [e for e in events if "error" in e], events[-3:]
    last = done[-1]["choices"][0]
    assert last["finish_reason"] == "length" and "vqpoold" in last["finish_detail"], last
    generated = sum(len(e["choices"][0]["token_ids"]) for e in done)
    assert 0 < generated < 30000
    stats = request_json(stack.url(LLAMA), "GET", "/v1/stats").body
    assert stats["active"] == 0 and stats["blocks"] == 0


def test_what_a_running_request_freed_while_the_daemon_was_stopped_is_freed_when_it_answers(
    stack: ServingStack,
) -> None:
    daemon = stack.daemon
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(
            stream_while, stack, lambda: daemon.process.send_signal(signal.SIGSTOP)
        )
        try:
            events = running.result(timeout=60)
        finally:
            daemon.process.send_signal(signal.SIGCONT)
    assert not [e for e in events if "error" in e], events[-3:]
    wait_until(lambda: health(stack) == "ok", timeout=10)
    # The same session is back: the request's free_all was sent to it, nothing is held.
    stack.wait_for_no_blocks(timeout=10)
    assert not daemon.admin("owners")
    assert stack.complete(LLAMA, {"prompt": "after", "max_tokens": 8}).status == 200


def test_what_was_freed_while_the_daemon_was_down_is_dropped_by_a_restarted_one(
    stack: ServingStack,
) -> None:
    events = stream_while(stack, stack.daemon.process.kill)
    assert not [e for e in events if "error" in e], events[-3:]
    stack.daemon.start()  # the same run directory: the worker re-syncs with it
    wait_until(lambda: health(stack) == "ok", timeout=15)
    stack.wait_for_no_blocks(timeout=10)  # the ended request's blocks were not claimed back
    assert stack.complete(LLAMA, {"prompt": "after", "max_tokens": 8}).status == 200
