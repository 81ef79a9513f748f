"""Two workers contending for a small pool: requests queue for blocks and complete, the pool is
never overdrawn, a request waits for blocks held elsewhere or gets 503 after --queue-timeout, a
request that runs out of blocks mid-generation ends with finish_reason "length", and no block
is held once everything is done (checked through the daemon's admin socket)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from serving_harness import ServingStack
from vqpool.worker import PoolClient
from vqpool.worker.testing.http_client import HttpReply, request_json

LLAMA = "builtin:llama"
QWEN3 = "builtin:qwen3"
N_BLOCKS = 64  # 32 K + 32 V blocks of 16 slots
PROMPT = "contention: " + "x" * 28  # 40 bytes; with 100 new tokens 9 blocks per stream


@pytest.fixture(scope="module")
def stack() -> Iterator[ServingStack]:
    serving = ServingStack(
        [LLAMA, QWEN3],
        daemon_args=("--n-blocks", str(N_BLOCKS), "--lease", "1"),
        # Two requests per worker (18 blocks per stream) leave room for one of the other's: the
        # models always share the pool while both have work, and together still outgrow it.
        worker_args=["--max-concurrent", "2", "--queue-timeout", "60", "--reserve", "on-demand"],
    ).start()
    yield serving
    serving.stop()


class PoolWatcher(threading.Thread):
    """Samples the daemon's view every few ms: blocks in use per stream and per model."""

    def __init__(self, stack: ServingStack) -> None:
        super().__init__(daemon=True)
        self.stack = stack
        self.stop_event = threading.Event()
        self.overdrawn: list[Any] = []
        self.peak_by_model: dict[str, int] = {}
        self.both_held = False

    def run(self) -> None:
        while not self.stop_event.is_set():
            for name, stream in self.stack.pool_streams().items():
                if not 0 <= stream["free"] <= stream["total"]:
                    self.overdrawn.append((name, stream))
            held = self.stack.blocks_by_model()
            if sum(held.values()) > N_BLOCKS:
                self.overdrawn.append(held)
            for model, n in held.items():
                self.peak_by_model[model] = max(self.peak_by_model.get(model, 0), n)
            self.both_held |= all(held.get(m, 0) > 0 for m in (LLAMA, QWEN3))
            time.sleep(0.005)


def test_contending_models_queue_for_blocks_and_all_complete(stack: ServingStack) -> None:
    watcher = PoolWatcher(stack)
    watcher.start()
    jobs = [LLAMA, QWEN3] * 6
    with ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(
            pool.map(lambda m: stack.complete(m, {"prompt": PROMPT, "max_tokens": 100}), jobs)
        )
    watcher.stop_event.set()
    watcher.join()
    for reply in replies:
        assert reply.status == 200, reply
        assert reply.body["usage"]["completion_tokens"] == 100
        assert reply.body["choices"][0]["finish_reason"] == "length"
    assert not watcher.overdrawn
    assert watcher.both_held, "the two models never held blocks at the same time"
    assert all(0 < watcher.peak_by_model[m] <= N_BLOCKS for m in (LLAMA, QWEN3))
    stats = [stack.worker_stats(m) for m in (LLAMA, QWEN3)]
    # 12 requests of 9 blocks per stream on 32 per stream: at most 3 run at once in the pool,
    # while the two workers would run 4. Admitted with their prompts plus a block (--reserve
    # on-demand), they contend as they grow: some wait, or are preempted and resume.
    assert sum(s["waits"] + s["preemptions"] for s in stats) > 0
    assert all(s["exhaustions"] == 0 for s in stats)
    stack.wait_for_no_blocks()


def hog_all_blocks(stack: ServingStack) -> PoolClient:
    """Another session that takes every free block (as another model's requests would)."""
    hog = PoolClient(stack.run_dir, name="hog")
    for stream in ("k", "v"):
        hog.allocate(stream, hog.n_free(stream) * hog.config.block_size, "hog-request")
    return hog


def test_request_waits_for_blocks_freed_elsewhere(stack: ServingStack) -> None:
    waits_before = stack.worker_stats(LLAMA)["waits"]
    with hog_all_blocks(stack) as hog, ThreadPoolExecutor(1) as pool:
        pending = pool.submit(stack.complete, LLAMA, {"prompt": PROMPT, "max_tokens": 20})
        deadline = time.monotonic() + 5
        while not stack.worker_stats(LLAMA)["waiting_for_blocks"]:
            assert time.monotonic() < deadline, "the request never waited for blocks"
            time.sleep(0.02)
        assert not pending.done()
        hog.free_all("hog-request")
        reply = pending.result(timeout=30)
    assert reply.status == 200 and reply.body["usage"]["completion_tokens"] == 20
    stats = stack.worker_stats(LLAMA)
    assert stats["waits"] == waits_before + 1
    assert stats["queue_length"] == 0
    stack.wait_for_no_blocks()


@pytest.fixture(scope="module")
def impatient(stack: ServingStack) -> Iterator[str]:
    """A third worker with --queue-timeout 1 and --reserve prompt; yields its URL."""
    worker = stack.start_worker(
        LLAMA, ["--queue-timeout", "1", "--reserve", "prompt"], name="impatient"
    )
    yield worker.url
    worker.stop()


def test_queue_timeout_gives_503_with_retry_after(stack: ServingStack, impatient: str) -> None:
    with hog_all_blocks(stack):
        started = time.monotonic()
        reply = request_json(
            impatient, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 8}
        )
        waited = time.monotonic() - started
    assert reply.status == 503, reply
    assert int(reply.headers["retry-after"]) >= 1
    assert "too few free blocks" in reply.body["error"]["message"]
    assert 0.9 <= waited < 10
    stats = request_json(impatient, "GET", "/v1/stats").body
    assert stats["queue_timeouts"] == 1 and stats["blocks"] == 0
    stack.wait_for_no_blocks()
    ok: HttpReply = request_json(
        impatient, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 8}
    )
    assert ok.status == 200


def test_running_out_of_blocks_mid_generation_ends_with_length(
    stack: ServingStack, impatient: str
) -> None:
    # --reserve prompt: only the prompt is reserved; 2000 tokens cannot fit in 32 x 16 slots.
    reply = request_json(
        impatient, "POST", "/v1/completions", {"prompt": "short prompt", "max_tokens": 2000}
    )
    assert reply.status == 200, reply
    choice = reply.body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert "ran out of blocks" in choice["finish_detail"]
    generated = reply.body["usage"]["completion_tokens"]
    assert 0 < generated < 2000
    assert len("short prompt") + generated <= (N_BLOCKS // 2) * 16
    stats = request_json(impatient, "GET", "/v1/stats").body
    assert stats["exhaustions"] == 1
    stack.wait_for_no_blocks()
