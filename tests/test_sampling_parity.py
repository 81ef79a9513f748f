"""Sampling as mlx_lm.server does it: the penalties, ``logit_bias`` and XTC change the tokens
exactly as mlx-lm's own logits processors and sampler do (against ``generate_step`` in-process,
token for token, batched rows with different processors side by side, a preempted row and a
prompt-cached one included); a ``seed`` gives a request the tokens ``generate_step`` gives after
``mx.random.seed`` alone and inside a batch; bad values are refused with 400 naming the field."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from serving_harness import ServingStack
from vqpool.worker.kv.cache_source import CacheSource, StockCacheSource
from vqpool.worker.models.loading import load_model
from vqpool.worker.models.tokenizer import ByteTokenizer
from vqpool.worker.pool.client import PoolClient
from vqpool.worker.run_worker import open_pool
from vqpool.worker.sched.sampling import SamplingParams
from vqpool.worker.sched.scheduler import GenerationJob, JobEnd, Scheduler
from vqpool.worker.testing.http_client import request_json, stream_events
from vqpool.worker.testing.launch import DaemonProcess

LLAMA = "builtin:llama"
MODEL = load_model(LLAMA).model
PROMPTS = [[1 + (i * 7 + j * 3) % 200 for j in range(n)] for i, n in enumerate([5, 23, 40, 9])]
N_TOKENS = 40

# Each processor on its own, then all at once (mlx_lm.server's request field names).
PROCESSORS: dict[str, dict[str, Any]] = {
    "repetition": {"repetition_penalty": 1.5, "repetition_context_size": 10},
    "presence": {"presence_penalty": 1.0},
    "frequency": {"frequency_penalty": 0.8, "frequency_context_size": 60},
    "logit_bias": {"logit_bias": {"65": 4.0, "101": 3.0, "32": -100.0}},
    "all": {
        "repetition_penalty": 1.3,
        "presence_penalty": 0.5,
        "presence_context_size": 5,
        "frequency_penalty": 0.4,
        "logit_bias": {"66": 2.5},
    },
}


def params_of(fields: dict[str, Any]) -> SamplingParams:
    """What the worker parses ``fields`` into (the logit_bias keys are JSON strings)."""
    values = dict(fields)
    if "logit_bias" in values:
        values["logit_bias"] = tuple((int(k), float(v)) for k, v in values["logit_bias"].items())
    if "temp" in values:
        values["temperature"] = values.pop("temp")
    return SamplingParams(**values)


def mlx_tokens(
    prompt: list[int], n: int, fields: dict[str, Any], seed: int | None = None
) -> list[int]:
    """What mlx-lm generates with its own processors and sampler, as mlx_lm.server makes them
    from ``fields`` (and ``mx.random.seed(seed)`` first, as mlx_lm.server does)."""
    f = dict(fields)
    bias = f.pop("logit_bias", None)
    processors = make_logits_processors(
        {int(k): float(v) for k, v in bias.items()} if bias else None,
        f.pop("repetition_penalty", 0.0),
        f.pop("repetition_context_size", 20),
        f.pop("presence_penalty", 0.0),
        f.pop("presence_context_size", 20),
        f.pop("frequency_penalty", 0.0),
        f.pop("frequency_context_size", 20),
    )
    sampler = make_sampler(
        f.pop("temp", 0.0),
        top_p=f.pop("top_p", 0.0),
        min_p=f.pop("min_p", 0.0),
        top_k=f.pop("top_k", 0),
        xtc_probability=f.pop("xtc_probability", 0.0),
        xtc_threshold=f.pop("xtc_threshold", 0.1),
        xtc_special_tokens=list(f.pop("xtc_special_tokens", ())),
    )
    assert not f, f"fields this reference does not know: {f}"
    if seed is not None:
        mx.random.seed(seed)
    steps = generate_step(
        mx.array(prompt),
        MODEL,
        max_tokens=n,
        sampler=sampler,
        logits_processors=processors,
        prompt_cache=make_prompt_cache(MODEL),
    )
    return [int(token) for token, _ in steps]


SCHEDULER_SETTINGS: dict[str, Any] = {
    "owner_prefix": "sampling",
    "eos_token_ids": frozenset(),
    "max_queue": 16,
    "queue_timeout": 60.0,
    "headroom_slots": 16,
}


def run_jobs(
    source: CacheSource,
    specs: Sequence[tuple[list[int], int, SamplingParams]],
    *,
    max_concurrent: int,
    prefill_step_size: int = 2048,
    reserve: str = "full",
) -> tuple[list[list[int]], list[GenerationJob]]:
    """Submit the jobs ``(prompt, max_tokens, sampling)`` at once; each job's tokens."""
    scheduler = Scheduler(
        MODEL,
        source,
        max_concurrent=max_concurrent,
        prefill_step_size=prefill_step_size,
        reserve=reserve,
        **SCHEDULER_SETTINGS,
    )
    jobs = [GenerationJob(p, n, sampling=s) for p, n, s in specs]
    # Queued before the generation thread starts: it admits them together (none waits for
    # the look-ahead of a row already decoding).
    for job in jobs:
        scheduler.submit(job)
    scheduler.start()
    try:
        return [tokens_to_the_end(job) for job in jobs], jobs
    finally:
        scheduler.stop()


def tokens_to_the_end(job: GenerationJob) -> list[int]:
    """The job's tokens; it must run to ``max_tokens``."""
    tokens: list[int] = []
    for event in iter(partial(job.events.get, timeout=60), None):
        if isinstance(event, JobEnd):
            assert event.finish_reason == "length", event
            break
        assert isinstance(event, int)
        tokens.append(event)
    return tokens


GREEDY = [mlx_tokens(p, N_TOKENS, {}) for p in PROMPTS]


@pytest.mark.parametrize("name", sorted(PROCESSORS))
def test_each_processor_changes_the_tokens_as_mlx_lms_own(name: str) -> None:
    fields = PROCESSORS[name]
    expected = [mlx_tokens(p, N_TOKENS, fields) for p in PROMPTS]
    # The premise: the processor changes what greedy decoding gives on this model.
    assert expected != GREEDY
    specs = [(p, N_TOKENS, params_of(fields)) for p in PROMPTS]
    alone, _ = run_jobs(StockCacheSource(MODEL), specs, max_concurrent=1)
    assert alone == expected
    # Batched, prompts prefilled in chunks between the running rows' steps.
    batched, _ = run_jobs(
        StockCacheSource(MODEL), specs, max_concurrent=len(specs), prefill_step_size=4
    )
    assert batched == expected


def test_rows_with_different_processors_side_by_side_keep_their_own() -> None:
    # One batch: every processor set and a plain greedy row, each on its own prompt.
    names = [*sorted(PROCESSORS), None]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    fields = [PROCESSORS[n] if n else {} for n in names]
    specs = [(p, N_TOKENS, params_of(f)) for p, f in zip(prompts, fields, strict=True)]
    results, _ = run_jobs(
        StockCacheSource(MODEL), specs, max_concurrent=len(specs), prefill_step_size=8
    )
    assert results == [mlx_tokens(p, N_TOKENS, f) for p, f in zip(prompts, fields, strict=True)]


def test_seeded_rows_sample_as_mlx_lm_after_mx_random_seed_alone_and_in_a_batch() -> None:
    sampled = {"temp": 0.8, "top_p": 0.95, "min_p": 0.02, "top_k": 50}
    cases = [
        (PROMPTS[0], {**sampled}, 7),
        (PROMPTS[1], {**sampled, **PROCESSORS["all"]}, 7),
        (PROMPTS[2], {"temp": 1.0, "xtc_probability": 0.5, "xtc_threshold": 0.05}, 3),
        (PROMPTS[3], {"temp": 0.7}, 11),
    ]
    expected = [mlx_tokens(p, N_TOKENS, f, seed) for p, f, seed in cases]
    specs = [(p, N_TOKENS, params_of({**f, "seed": seed})) for p, f, seed in cases]
    alone, _ = run_jobs(StockCacheSource(MODEL), specs, max_concurrent=1)
    assert alone == expected
    # With unseeded sampled rows beside them, which draw from the global stream.
    noise = [(PROMPTS[i], N_TOKENS, params_of({"temp": 1.0})) for i in range(3)]
    mixed, _ = run_jobs(
        StockCacheSource(MODEL), [*noise, *specs], max_concurrent=8, prefill_step_size=4
    )
    assert mixed[len(noise) :] == expected
    # Another seed, another text.
    other = [(p, N_TOKENS, params_of({**f, "seed": seed + 1})) for p, f, seed in cases]
    assert run_jobs(StockCacheSource(MODEL), other, max_concurrent=4)[0] != expected


@pytest.fixture
def pooled(
    start_daemon: Callable[..., DaemonProcess],
) -> Iterator[Callable[[int], CacheSource]]:
    pools: list[PoolClient] = []

    def make(n_blocks: int) -> CacheSource:
        daemon = start_daemon("--n-blocks", str(n_blocks))
        pool, source = open_pool(str(daemon.run_dir), "sampling", MODEL, 5.0)
        pools.append(pool)
        return source

    yield make
    for pool in pools:
        pool.close()


def test_a_preempted_row_resumes_with_the_same_history_and_random_stream(pooled: Any) -> None:
    # test_preemption's pair: together, padded to the longer row, they outgrow 8 blocks per
    # stream after ~40 tokens and the short one (cheaper to recompute) is preempted, then
    # resumed with its generated tokens as prompt; its processors and its seeded sampler go on
    # as if nothing happened.
    short = [1 + (j * 3) % 200 for j in range(5)]
    long = [1 + (7 + j * 3) % 200 for j in range(23)]
    fields = {"temp": 0.9, "frequency_penalty": 0.6, "frequency_context_size": 100}
    specs = [
        (long, 60, params_of(PROCESSORS["all"])),
        (short, 60, params_of({**fields, "seed": 5})),
    ]
    results, jobs = run_jobs(pooled(16), specs, max_concurrent=2, reserve="on-demand")
    assert jobs[1].preemptions >= 1
    assert results == [
        mlx_tokens(long, 60, PROCESSORS["all"]),
        mlx_tokens(short, 60, fields, seed=5),
    ]


# Over HTTP: real worker processes.


@pytest.fixture(scope="module")
def stack() -> Iterator[ServingStack]:
    serving = ServingStack(
        [LLAMA],
        daemon_args=("--n-blocks", "8192", "--lease", "1"),
        worker_args=["--max-concurrent", "8"],
    ).start()
    yield serving
    serving.stop()


def complete(stack: ServingStack, body: dict[str, Any]) -> dict[str, Any]:
    reply = stack.complete(LLAMA, {"return_token_ids": True, **body})
    assert reply.status == 200, reply
    result: dict[str, Any] = reply.body
    return result


def test_penalties_over_http_equal_mlx_lm_also_from_the_prompt_cache(stack: ServingStack) -> None:
    prompt = ByteTokenizer().encode("penalties from a cached prefix, " * 3)
    fields = PROCESSORS["all"]
    expected = mlx_tokens(prompt, N_TOKENS, fields)
    first = complete(stack, {"prompt": prompt, "max_tokens": N_TOKENS, **fields})
    assert first["choices"][0]["token_ids"] == expected
    # The same prompt again: its prefix comes from the prompt cache, the history is the same.
    again = complete(stack, {"prompt": prompt, "max_tokens": N_TOKENS, **fields})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"][0]["token_ids"] == expected
    chat = stack.complete(
        LLAMA,
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **fields},
        path="/v1/chat/completions",
    )
    assert chat.status == 200, chat


def test_a_seeded_request_gives_the_same_text_alone_and_in_a_batch_of_8(
    stack: ServingStack,
) -> None:
    seeded = {"prompt": "The pool is shared", "max_tokens": N_TOKENS, "temperature": 0.8}
    alone = complete(stack, {**seeded, "seed": 7})["choices"][0]
    assert complete(stack, {**seeded, "seed": 7})["choices"][0]["text"] == alone["text"]
    assert complete(stack, {**seeded, "seed": 8})["choices"][0]["text"] != alone["text"]
    # Seven different requests running (each has sent a token) while the seeded one runs.
    others = [
        stream_events(
            stack.url(LLAMA),
            "/v1/completions",
            {
                "prompt": f"other request {i}",
                "max_tokens": 3000,
                "temperature": 0.5 + i / 10,
                **({"seed": i} if i % 2 else {"presence_penalty": 0.5}),
            },
        )
        for i in range(7)
    ]
    try:
        for events in others:
            next(events)
        assert stack.worker_stats(LLAMA)["active"] == 7
        batched = complete(stack, {**seeded, "seed": 7})["choices"][0]
        # The seven were running from before the seeded request began until after it ended.
        assert stack.worker_stats(LLAMA)["active"] == 7
    finally:
        for events in others:
            events.close()
    assert batched["text"] == alone["text"]
    assert batched["token_ids"] == alone["token_ids"]
    stack.wait_for_no_blocks()


def test_xtc_is_accepted_and_seeded_xtc_is_reproducible(stack: ServingStack) -> None:
    body = {
        "prompt": "xtc",
        "max_tokens": N_TOKENS,
        "temperature": 1.0,
        "xtc_probability": 0.9,
        "xtc_threshold": 0.02,
        "seed": 3,
    }
    first = complete(stack, body)["choices"][0]["token_ids"]
    assert complete(stack, body)["choices"][0]["token_ids"] == first
    assert complete(stack, {**body, "xtc_probability": 0.0})["choices"][0]["token_ids"] != first


BAD_VALUES: list[tuple[str, Any]] = [
    ("repetition_penalty", -0.5),
    ("repetition_penalty", "1.2"),
    ("repetition_context_size", -1),
    ("repetition_context_size", 2.5),
    ("presence_penalty", True),
    ("presence_context_size", "20"),
    ("frequency_penalty", [1]),
    ("frequency_penalty", 10**400),
    ("frequency_context_size", -3),
    ("logit_bias", [1, 2]),
    ("logit_bias", {"abc": 1.0}),
    ("logit_bias", {"100000": 1.0}),
    ("logit_bias", {"-1": 1.0}),
    ("logit_bias", {"5": "high"}),
    ("logit_bias", {"5": -(10**400)}),
    ("xtc_probability", 1.5),
    ("xtc_probability", -0.1),
    ("xtc_threshold", 0.6),
    ("xtc_threshold", "0.1"),
    ("seed", -1),
    ("seed", 1.5),
    ("seed", 2**64),
    ("seed", "7"),
]


def test_bad_values_are_refused_with_400_naming_the_field(stack: ServingStack) -> None:
    before = stack.worker_stats(LLAMA)["requests"]
    for field, value in BAD_VALUES:
        reply = request_json(
            stack.url(LLAMA),
            "POST",
            "/v1/completions",
            {"prompt": "hi", "max_tokens": 4, field: value},
        )
        assert reply.status == 400, (field, value, reply)
        error = reply.body["error"]
        assert error["param"] == field and field in error["message"], (field, value, error)
    # Nothing ran, nothing is held, and the worker serves on.
    assert stack.worker_stats(LLAMA)["requests"] == before
    stack.wait_for_no_blocks()
    assert complete(stack, {"prompt": "hi", "max_tokens": 4})["choices"][0]["finish_reason"]


def test_a_seed_with_temperature_zero_is_greedy(stack: ServingStack) -> None:
    prompt = PROMPTS[1]
    reply = complete(stack, {"prompt": prompt, "max_tokens": N_TOKENS, "seed": 42})
    assert reply["choices"][0]["token_ids"] == GREEDY[1]
