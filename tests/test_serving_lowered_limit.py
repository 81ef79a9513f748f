"""Lowering a model's limit below what its prompt cache holds, with two real workers that both
cache prompts: the limit is met from that model's own cache (never another model's), and the
model's next request is served, not left waiting until its queue timeout (issue 23, finding 2).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
from daemon_harness import wait_until
from serving_harness import ServingStack

LLAMA = "builtin:llama"
QWEN = "builtin:qwen3"
KIB = 1024
LIMIT = 160 * KIB  # qwen3's lowered limit: its cache holds about 400 KiB then

log = logging.getLogger(__name__)


@pytest.fixture
def stack() -> Iterator[ServingStack]:
    serving = ServingStack(
        [LLAMA, QWEN],
        daemon_args=("--budget", "16MiB", "--lease", "1"),
        worker_args=["--queue-timeout", "15"],
    ).start()
    yield serving
    serving.stop()


def complete(stack: ServingStack, model: str, prompt: list[int], max_tokens: int) -> Any:
    return stack.complete(model, {"prompt": prompt, "max_tokens": max_tokens})


def cache_of(stack: ServingStack, model: str) -> dict[str, Any]:
    cache: dict[str, Any] = stack.worker_stats(model)["prompt_cache"]
    return cache


def daemon_cache_bytes(stack: ServingStack, model: str) -> int:
    return sum(
        (s["prompt_cache"] or {}).get("bytes", 0)
        for s in stack.daemon.admin("sessions")
        if s["model"] == model
    )


def test_a_lowered_limit_is_met_from_the_models_own_cache_and_its_next_request_is_served(
    stack: ServingStack,
) -> None:
    rng = random.Random(2)
    for model, n in ((QWEN, 4), (LLAMA, 2)):
        for _ in range(n):  # 200 + 8 tokens each: 13 blocks per stream, 104 KiB cached
            reply = complete(stack, model, [rng.randrange(256) for _ in range(200)], 8)
            assert reply.status == 200, reply
    qwen_before, llama_before = cache_of(stack, QWEN), cache_of(stack, LLAMA)
    assert qwen_before["bytes"] > 2 * LIMIT and llama_before["bytes"] > 0
    wait_until(lambda: daemon_cache_bytes(stack, QWEN) == qwen_before["bytes"], timeout=5)
    started = time.monotonic()
    stack.daemon.admin("model_set", model=QWEN, limit=LIMIT)
    # 60 + 20 tokens: 5 blocks per stream, 40 KiB; qwen3 holds more than its limit in cache.
    reply = complete(stack, QWEN, [rng.randrange(256) for _ in range(60)], 20)
    served_after = time.monotonic() - started
    assert reply.status == 200, (reply, stack.logs())
    qwen_after, llama_after = cache_of(stack, QWEN), cache_of(stack, LLAMA)
    # Another model's cache gave nothing.
    assert llama_after["bytes"] == llama_before["bytes"], llama_after
    assert llama_after["evictions"] == llama_before["evictions"], llama_after
    # qwen3's holdings went down to its limit, from its own cache.
    held = {v["model"]: v["held"] for v in stack.daemon.admin("model_list")["models"]}
    assert held[QWEN] <= LIMIT, held
    log.warning(
        "figures: next request served %.2f s after model set --limit; qwen3's cache %d -> %d "
        "bytes (%d entries evicted; the new request's entry stored), llama's %d -> %d",
        served_after,
        qwen_before["bytes"],
        qwen_after["bytes"],
        qwen_after["evictions"] - qwen_before["evictions"],
        llama_before["bytes"],
        llama_after["bytes"],
    )
    stack.daemon.audit()
