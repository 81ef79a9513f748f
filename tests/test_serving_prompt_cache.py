"""The prompt cache through a live vqpoold and real vqpool-worker processes: identical greedy
tokens and logprobs with and without it (streamed and not), cached bytes as the daemon, vqpoolctl
and the metrics count them, ``vqpoolctl cache drop``, and a daemon restart (claims keep the
cache's blocks: a correct hit) or an eviction of the session (a clean miss, never a wrong hit)."""

from __future__ import annotations

import random
import signal
from collections.abc import Iterator
from typing import Any

import pytest
from ctl_harness import ctl_json, run_ctl
from daemon_harness import wait_until
from serving_harness import ServingStack, builtin_weights
from test_metrics_http import metrics_url, scrape, value
from vqpool.shared.pool import AllocationRequest
from vqpool.shared.protocol import session_label
from vqpool.worker import PoolClient
from vqpool.worker.testing.http_client import request_json, stream_events
from vqpool.worker.testing.launch import DaemonProcess

LLAMA = "builtin:llama"  # served with the prompt cache (the default)
PLAIN = "plain-llama"  # the same weights, --prompt-cache-bytes 0
DAEMON_ARGS = ("--n-blocks", "512", "--lease", "1", "--metrics-port", "0")
N_TOKENS = 12


@pytest.fixture(scope="module")
def stack() -> Iterator[ServingStack]:
    serving = ServingStack([LLAMA], daemon_args=DAEMON_ARGS).start()
    serving.workers[PLAIN] = serving.start_worker(
        LLAMA, ["--served-model-name", PLAIN, "--prompt-cache-bytes", "0"], name="plain"
    )
    yield serving
    serving.stop()


def ask(stack: ServingStack, model: str, prompt: list[int], stream: bool) -> dict[str, Any]:
    """Generated ids, their logprobs and the cached prompt tokens of one greedy request."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": N_TOKENS,
        "logprobs": True,
        "return_token_ids": True,
    }
    if stream:
        events = list(
            stream_events(
                stack.url(model),
                "/v1/completions",
                {**body, "stream_options": {"include_usage": True}},
            )
        )
        choices = [e["choices"][0] for e in events if e["choices"]]
        ids = [i for c in choices for i in c.get("token_ids", [])]
        logprobs = [
            x["logprob"] for c in choices for x in (c.get("logprobs") or {"content": []})["content"]
        ]
        usage = events[-1]["usage"]
    else:
        reply = request_json(stack.url(model), "POST", "/v1/completions", body)
        assert reply.status == 200, reply
        choice = reply.body["choices"][0]
        ids = choice["token_ids"]
        logprobs = [x["logprob"] for x in choice["logprobs"]["content"]]
        usage = reply.body["usage"]
    assert len(ids) == len(logprobs) == N_TOKENS
    return {
        "ids": ids,
        "logprobs": logprobs,
        "cached": usage["prompt_tokens_details"]["cached_tokens"],
    }


def same_output(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a["ids"], a["logprobs"]) == (b["ids"], b["logprobs"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_outputs_are_identical_with_and_without_the_cache(
    stack: ServingStack, stream: bool
) -> None:
    rng = random.Random(int(stream))
    turn1 = [rng.randrange(256) for _ in range(150)]
    first = ask(stack, LLAMA, turn1, stream)
    baseline = ask(stack, PLAIN, turn1, stream)
    assert first["cached"] == 0 and baseline["cached"] == 0
    assert same_output(first, baseline)
    retried = ask(stack, LLAMA, turn1, stream)
    assert retried["cached"] == 149  # at least one prompt token is prefilled
    assert same_output(retried, baseline)
    turn2 = turn1 + first["ids"] + [rng.randrange(256) for _ in range(20)]
    second = ask(stack, LLAMA, turn2, stream)
    assert second["cached"] == 150 + N_TOKENS
    assert same_output(second, ask(stack, PLAIN, turn2, stream))


def cache_owners(daemon: DaemonProcess, model: str) -> list[dict[str, Any]]:
    return [o for o in daemon.admin("owners") if o["model"] == model and "-cache-" in o["owner"]]


def session_of(daemon: DaemonProcess, model: str) -> dict[str, Any]:
    (session,) = [s for s in daemon.admin("sessions") if s["model"] == model]
    return session


def test_cached_bytes_are_counted_shown_and_dropped(stack: ServingStack) -> None:
    rng = random.Random(5)
    for n in (40, 90):
        ask(stack, LLAMA, [rng.randrange(256) for _ in range(n)], stream=False)
    daemon = stack.daemon

    # An ended request's entry is stored after its response (its blocks come back first), so
    # the worker's own figures are read again until its heartbeat has told the daemon the same.
    def reported() -> bool:
        stats = stack.worker_stats(LLAMA)["prompt_cache"]
        at_daemon = session_of(daemon, LLAMA)["prompt_cache"]
        return at_daemon == {k: stats[k] for k in at_daemon} and at_daemon["entries"] == len(
            cache_owners(daemon, LLAMA)
        )

    wait_until(reported, timeout=30)
    session = session_of(daemon, LLAMA)
    owners = cache_owners(daemon, LLAMA)
    per_block = session["bytes_per_block"]
    held_bytes = sum(n * per_block[s] for o in owners for s, n in o["blocks"].items())
    cached = session["prompt_cache"]
    assert cached["entries"] == len(owners) > 0
    assert cached["blocks"] == sum(o["n_blocks"] for o in owners)
    assert cached["bytes"] == held_bytes > 0
    assert session["prompt_cache"]["bytes"] <= session["bytes_total"]
    assert session_of(daemon, PLAIN)["prompt_cache"] is None  # no cache: nothing reported

    status = ctl_json(stack.run_dir, "status")
    assert status["models"][LLAMA]["prompt_cache"]["bytes"] == cached["bytes"]
    listing = ctl_json(stack.run_dir, "cache", "list")
    assert listing[LLAMA]["hits"] == cached["hits"] and listing[PLAIN] is None
    table = run_ctl(stack.run_dir, "cache", "list").stdout.splitlines()
    assert table[0].split()[:3] == ["MODEL", "CACHED", "BLOCKS"]
    row = next(line.split() for line in table if line.startswith(LLAMA))
    assert row[3:6] == [str(cached["blocks"]), str(cached["entries"]), str(cached["lookups"])]
    assert any(line.startswith(PLAIN) and line.split()[1] == "-" for line in table)
    frame = run_ctl(stack.run_dir, "watch", "--count", "1").stdout
    assert "cached " in frame, frame
    _, samples = scrape(metrics_url(daemon))
    assert value(samples, "vqpool_model_prompt_cache_bytes", model=LLAMA) == cached["bytes"]
    assert (
        value(samples, "vqpool_model_prompt_cache_lookups_total", model=LLAMA) == cached["lookups"]
    )

    dropped = run_ctl(stack.run_dir, "cache", "drop", LLAMA)
    assert dropped.returncode == 0, dropped.stderr
    wait_until(lambda: not cache_owners(daemon, LLAMA), timeout=5)
    wait_until(lambda: session_of(daemon, LLAMA)["prompt_cache"]["bytes"] == 0, timeout=5)
    assert stack.worker_stats(LLAMA)["prompt_cache"]["entries"] == 0
    daemon.audit()
    unknown = run_ctl(stack.run_dir, "cache", "drop", "no-such-model")
    assert unknown.returncode == 4 and "no worker of model" in unknown.stderr


def test_after_a_daemon_restart_a_hit_is_right_and_after_an_eviction_a_clean_miss(
    stack: ServingStack,
) -> None:
    rng = random.Random(9)
    prompt = [rng.randrange(256) for _ in range(150)]
    baseline = ask(stack, PLAIN, prompt, stream=False)
    ask(stack, LLAMA, prompt, stream=False)
    wait_until(lambda: cache_owners(stack.daemon, LLAMA), timeout=5)
    held = {o["owner"]: o["blocks"] for o in cache_owners(stack.daemon, LLAMA)}

    stack.daemon.stop(signal.SIGKILL)
    stack.daemon = DaemonProcess(stack.run_dir, *DAEMON_ARGS).start()
    wait_until(lambda: not stack.daemon.admin("stats")["claims"]["active"], timeout=10)
    # The workers claimed the cache's blocks back with the rest.
    assert {o["owner"]: o["blocks"] for o in cache_owners(stack.daemon, LLAMA)} == held
    after_restart = ask(stack, LLAMA, prompt, stream=False)
    assert after_restart["cached"] == 149 and same_output(after_restart, baseline)

    # An evicted session's blocks are freed by the daemon: the cache must not use them again.
    sid = session_of(stack.daemon, LLAMA)["sid"]
    stack.daemon.admin("evict_session", sid=sid)

    def new_session() -> bool:
        health = request_json(stack.url(LLAMA), "GET", "/health")
        return health.status == 200 and health.body["session"] not in (session_label(sid), None)

    wait_until(new_session, timeout=10)
    after_eviction = ask(stack, LLAMA, prompt, stream=False)
    assert after_eviction["cached"] == 0 and same_output(after_eviction, baseline)
    stack.wait_for_no_blocks()


def test_another_models_waiting_allocation_gets_the_cached_memory() -> None:
    block_bytes = 4096  # builtin:llama, per stream and block
    budget_blocks = 64
    stack = ServingStack(
        [LLAMA],
        daemon_args=(
            "--budget",
            f"{budget_blocks * block_bytes + builtin_weights(LLAMA)}B",
            "--lease",
            "1",
        ),
    ).start()
    try:
        ask(stack, LLAMA, list(range(150)), stream=False)  # 162 tokens: 11 blocks per stream
        wait_until(lambda: cache_owners(stack.daemon, LLAMA), timeout=5)
        assert stack.worker_stats(LLAMA)["prompt_cache"]["blocks"] == 22
        with PoolClient(stack.run_dir, name="other", bytes_per_block=block_bytes) as other:
            n_tokens = budget_blocks // 2 * other.config.block_size
            requests = [AllocationRequest(s, n_tokens, "whole-budget", "fp16") for s in "kv"]
            # Parked at the daemon; the cache holder is told at its next heartbeat.
            granted = other.allocate_many(requests, wait=10)
            assert all(isinstance(blocks, list) for blocks in granted), granted
            stats = stack.worker_stats(LLAMA)["prompt_cache"]
            assert stats["entries"] == 0 and stats["evictions"] >= 1
            assert not cache_owners(stack.daemon, LLAMA)
            other.free_all("whole-budget")
    finally:
        stack.stop()
