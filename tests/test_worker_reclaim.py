"""A real vqpool-worker answers the daemon's reclaim asks: while it holds another model's reserve
on loan (``--lend-reserves``), that model asks for its reserve and gets it within the deadline;
the worker preempts its newest request to give the bytes back, the preemption is counted at the
daemon, its clients still get whole responses equal to unpreempted ones, and nothing leaks."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from serving_harness import ServingStack, builtin_weights
from vqpool.worker import PoolClient

LLAMA = "builtin:llama"
BLOCK = 16
BLOCK_BYTES = 4096  # builtin:llama, per stream and block of 16 slots
BUDGET_BLOCKS = 64  # block ids (K and V counted apart)
RESERVE_BLOCKS = 32  # model a's reserve; the rest (32) is llama's without a loan
# Each request alone: 120 + 100 slots = 14 blocks per stream (28 ids, within llama's 32); the
# two together hold more than 32 from their admission on: a's reserve is on loan to llama.
PROMPTS = [[1 + (i * 11 + j * 3) % 200 for j in range(120)] for i in range(2)]
MAX_TOKENS = 100


@pytest.fixture
def stack() -> Iterator[ServingStack]:
    serving = ServingStack(
        [LLAMA],
        daemon_args=(
            "--budget",
            f"{BUDGET_BLOCKS * BLOCK_BYTES + builtin_weights(LLAMA)}B",
            "--lend-reserves",
            "--lease",
            "1",
        ),
        worker_args=["--max-concurrent", "2", "--queue-timeout", "30", "--prompt-cache-bytes", "0"],
    ).start()
    serving.daemon.admin("model_set", create=True, model="a", reserve=RESERVE_BLOCKS * BLOCK_BYTES)
    yield serving
    serving.stop()


def complete(stack: ServingStack, prompt: list[int]) -> list[int]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    reply = stack.complete(LLAMA, {**body, "return_token_ids": True})
    assert reply.status == 200, reply
    choice = reply.body["choices"][0]
    assert choice["finish_reason"] == "length" and "detail" not in choice, choice
    tokens: list[int] = choice["token_ids"]
    return tokens


def test_a_lent_reserve_comes_back_from_a_serving_worker(stack: ServingStack) -> None:
    reference = [complete(stack, prompt) for prompt in PROMPTS]
    # a's session is open before the requests start: they run for a fraction of a second,
    # and a session opened only once they run could come after their end.
    with (
        PoolClient(stack.run_dir, name="a", bytes_per_block=BLOCK_BYTES) as owner_a,
        ThreadPoolExecutor(2) as pool,
    ):
        running = [pool.submit(complete, stack, prompt) for prompt in PROMPTS]
        deadline = time.monotonic() + 20
        while stack.daemon.admin("budget")["lent"] == 0:
            assert time.monotonic() < deadline, (stack.worker_stats(LLAMA), stack.logs())
            time.sleep(0.002)
        # a's whole reserve; most of it is on loan: the daemon asks llama's worker for it.
        for stream in ("k", "v"):
            blocks = owner_a.allocate(stream, RESERVE_BLOCKS // 2 * BLOCK, "a-0", wait=5.0)
            assert len(blocks) == RESERVE_BLOCKS // 2
        # a is granted as llama's worker frees; its answer to the ask follows the frees.
        deadline = time.monotonic() + 5
        while (view := stack.daemon.admin("budget")["reclaim"])["answered"] < 1:
            assert time.monotonic() < deadline, view
            time.sleep(0.01)
        assert view["asked"] >= 1 and view["late"] == 0, view
        assert view["latency_p99_s"] is not None
        assert view["latency_p99_s"] <= view["deadline_s"], view
        stack.daemon.audit()  # no block held by two owners
        # Llama's requests go on within its own share meanwhile, one at a time.
        results = [future.result(60) for future in running]
    assert results == reference
    stats = stack.worker_stats(LLAMA)
    assert stats["preemptions"] >= 1 and stats["exhaustions"] == 0
    deadline = time.monotonic() + 10
    while stack.daemon.admin("budget")["reclaim"]["preemptions"] < stats["preemptions"]:
        assert time.monotonic() < deadline, "the daemon never heard of the preemptions"
        time.sleep(0.05)
    stack.wait_for_no_blocks()
