"""Speculative decoding: ``vqpool-worker --draft-model`` and the request fields
``draft_model``/``num_draft_tokens``, through real worker processes on a real vqpoold.

At temperature 0 a draft model changes how fast tokens come, never which: a run with a draft
(one that agrees with the model on every token, and one that almost never does) gives the
tokens of the same run without one, and of mlx-lm's ``generate_step``. The draft's KV lives in
the request's pool blocks: the session declares the model's and the draft's bytes per block,
and every block goes back when the requests end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from serving_harness import ServingStack, greedy_token_ids
from vqpool.worker.kv.cache import make_pooled_cache
from vqpool.worker.kv.storage import KVLayout
from vqpool.worker.models.loading import load_model
from vqpool.worker.pool.client import PoolClient
from vqpool.worker.run_worker import open_pool
from vqpool.worker.sched.scheduler import GenerationJob, JobEnd, Scheduler, ScoredToken
from vqpool.worker.testing.http_client import request_json, stream_events
from vqpool.worker.testing.launch import DaemonProcess, ProcessExitedError, WorkerProcess
from vqpool.worker.testing.model_dirs import ARCHITECTURES, write_config_dir, write_model_dir

PROMPTS = ["hello how are you", "the quick brown fox jumps over the lazy dog. why share"]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The model (llama, 4 layers) and a draft of another architecture and KV layout (qwen3,
    2 layers); both directories have the same tokenizer."""
    base = tmp_path_factory.mktemp("draft")
    model = write_config_dir(base / "model", {**ARCHITECTURES["llama"], "num_hidden_layers": 4}, 1)
    draft = write_model_dir(base / "draft", "qwen3", seed=2)
    return {"model": model, "draft": draft}


@pytest.fixture(scope="module")
def stack(dirs: dict[str, Path]) -> Iterator[ServingStack]:
    serving = ServingStack([str(dirs["model"])]).start()
    yield serving
    serving.stop()


def _reference(model_dir: Path, prompt: str) -> list[int]:
    model, tokenizer = load(str(model_dir))
    tokens = mx.array(tokenizer.encode(prompt))
    return [int(t) for t, _ in generate_step(tokens, model, max_tokens=MAX_TOKENS)]


@pytest.mark.parametrize("draft", ["draft", "model"])
def test_a_draft_model_gives_the_tokens_of_the_model_alone(
    draft: str, dirs: dict[str, Path], stack: ServingStack
) -> None:
    """``draft`` "model": the model is its own draft (every draft token accepted, the draft's
    catch-up token every round); "draft": another model (drafts rejected, their slots
    trimmed)."""
    model_dir = str(dirs["model"])
    plain_url = stack.url(model_dir)
    worker = stack.start_worker(
        model_dir, ["--draft-model", str(dirs[draft])], name=f"with-{draft}"
    )
    try:
        for prompt in PROMPTS:
            alone = greedy_token_ids(plain_url, prompt, MAX_TOKENS)
            assert alone == _reference(dirs["model"], prompt)
            for n_draft in (None, 0, 1, 5):
                fields = {} if n_draft is None else {"num_draft_tokens": n_draft}
                assert greedy_token_ids(worker.url, prompt, MAX_TOKENS, **fields) == alone, (
                    n_draft,
                    prompt,
                )
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            events = stream_events(
                worker.url, "/v1/completions", {**body, "stream": True, "return_token_ids": True}
            )
            streamed = [t for e in events if e["choices"] for t in e["choices"][0]["token_ids"]]
            assert streamed == alone
        accepted = request_json(worker.url, "GET", "/v1/stats").body["draft_accepted"]
        if draft == "model":  # its drafts are the model's own tokens (all but a few accepted)
            assert accepted > len(PROMPTS) * 4 * MAX_TOKENS // 2
        # The draft's KV is charged with the model's: one session, the pair's bytes per block.
        model, _ = load(model_dir)
        draft_model, _ = load(str(dirs[draft]))
        block_size = request_json(worker.url, "GET", "/v1/stats").body["block_size"]
        pair = [KVLayout.from_model(m, block_size) for m in (model, draft_model)]
        sessions = [s for s in stack.daemon.admin("sessions") if s["pid"] == worker.pid]
        assert len(sessions) == 1
        assert sessions[0]["bytes_per_block"]["k"] == sum(p.k_block_bytes for p in pair)
        assert sessions[0]["bytes_per_block"]["v"] == sum(p.v_block_bytes for p in pair)
    finally:
        worker.stop()
    stack.wait_for_no_blocks()


def test_num_draft_tokens_out_of_bounds_is_refused_by_name(
    dirs: dict[str, Path], stack: ServingStack
) -> None:
    model_dir = str(dirs["model"])
    worker = stack.start_worker(model_dir, ["--draft-model", str(dirs["draft"])], name="bounds")
    try:
        body = {"prompt": "hello", "max_tokens": 2}
        before = request_json(worker.url, "GET", "/v1/stats").body["requests"]
        for bad in (-1, 65, 1.5, "3", True):
            reply = request_json(
                worker.url, "POST", "/v1/completions", {**body, "num_draft_tokens": bad}
            )
            assert reply.status == 400, reply
            assert reply.body["error"]["param"] == "num_draft_tokens"
            assert (
                "num_draft_tokens must be an integer in [0, 64]" in reply.body["error"]["message"]
            )
        other = request_json(
            worker.url, "POST", "/v1/completions", {**body, "draft_model": "some/draft"}
        )
        assert other.status == 400, other
        assert other.body["error"]["param"] == "draft_model"
        assert "this worker's draft model is" in other.body["error"]["message"]
        assert request_json(worker.url, "GET", "/v1/stats").body["requests"] == before
        for same in (str(dirs["draft"]), None):
            reply = request_json(
                worker.url, "POST", "/v1/completions", {**body, "draft_model": same}
            )
            assert reply.status == 200, reply
    finally:
        worker.stop()
    # Without a draft model num_draft_tokens is checked and unused (as mlx_lm.server), and a
    # draft model per request is refused: it would reload the model under running requests.
    plain_url = stack.url(model_dir)
    assert (
        request_json(plain_url, "POST", "/v1/completions", {**body, "num_draft_tokens": 3}).status
        == 200
    )
    bad = request_json(plain_url, "POST", "/v1/completions", {**body, "num_draft_tokens": 65})
    assert bad.status == 400 and bad.body["error"]["param"] == "num_draft_tokens"
    no_draft = request_json(
        plain_url, "POST", "/v1/completions", {**body, "draft_model": str(dirs["draft"])}
    )
    assert no_draft.status == 400, no_draft
    assert "this worker has no draft model" in no_draft.body["error"]["message"]
    assert "--draft-model" in no_draft.body["error"]["message"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--num-draft-tokens", "65"], "--num-draft-tokens must be in 0..64"),
        (["--draft-model", "/no/such/dir"], "--draft-model /no/such/dir: no such directory"),
        (["--draft-model", "builtin:llama"], "a draft model needs the model's tokenizer"),
    ],
)
def test_a_draft_model_the_worker_cannot_use_stops_it_with_one_line(
    args: list[str], says: str, dirs: dict[str, Path], tmp_path: Path
) -> None:
    worker = WorkerProcess(str(dirs["model"]), tmp_path / "w.log", no_pool=True, args=args)
    with pytest.raises(ProcessExitedError) as failed:
        worker.start()
    assert failed.value.status == 2
    assert says in worker.log()


def test_a_draft_request_the_pool_cannot_hold_ends_with_length_and_gives_every_block_back(
    dirs: dict[str, Path],
) -> None:
    """16 blocks (8 per stream: 128 token slots of both models): a request that needs more
    ends with what it made ("length", the reason in ``finish_detail``), its tokens those of
    the model alone, and the pool is whole after."""
    stack = ServingStack(
        [str(dirs["model"])],
        daemon_args=("--n-blocks", "16", "--lease", "1"),
        worker_args=["--draft-model", str(dirs["draft"]), "--reserve", "prompt"],
    ).start()
    try:
        no_eos = {"0": -100.0}  # EOS (id 0) never comes: the pool ends the request
        body = {"prompt": PROMPTS[1], "max_tokens": 400, "return_token_ids": True}
        body["logit_bias"] = no_eos
        reply = stack.complete(str(dirs["model"]), body)
        assert reply.status == 200, reply
        choice = reply.body["choices"][0]
        assert choice["finish_reason"] == "length"
        assert "ran out of blocks" in choice["finish_detail"]
        made = choice["token_ids"]
        assert 0 < len(made) < 128
        model, tokenizer = load(str(dirs["model"]))
        prompt = mx.array(tokenizer.encode(PROMPTS[1]))
        processors = make_logits_processors({0: -100.0})
        steps = generate_step(prompt, model, max_tokens=len(made), logits_processors=processors)
        alone = [int(t) for t, _ in steps]
        assert made == alone
        stack.wait_for_no_blocks()
    finally:
        stack.stop()


def test_a_seeded_sampled_draft_request_gives_mlx_lm_s_tokens(
    dirs: dict[str, Path], stack: ServingStack
) -> None:
    """At temperature 0.8 with a ``seed``, the tokens of mlx-lm's ``speculative_generate_step``
    after ``mx.random.seed(seed)`` (what mlx_lm.server runs for such a request), twice."""
    worker = stack.start_worker(
        str(dirs["model"]), ["--draft-model", str(dirs["draft"])], name="seeded"
    )
    try:
        body = {"temperature": 0.8, "seed": 1234, "num_draft_tokens": 2}
        first = greedy_token_ids(worker.url, PROMPTS[0], MAX_TOKENS, **body)
        assert greedy_token_ids(worker.url, PROMPTS[0], MAX_TOKENS, **body) == first
    finally:
        worker.stop()
    model, tokenizer = load(str(dirs["model"]))
    draft_model, _ = load(str(dirs["draft"]))
    mx.random.seed(1234)
    rounds = speculative_generate_step(
        mx.array(tokenizer.encode(PROMPTS[0])),
        model,
        draft_model,
        num_draft_tokens=2,
        max_tokens=MAX_TOKENS,
        sampler=make_sampler(0.8),
    )
    expected: list[int] = []
    for token, _, _ in rounds:
        expected.append(int(token))
        if expected[-1] in tokenizer.eos_token_ids:
            break
    assert first == expected


def test_a_preempted_draft_request_resumes_with_the_tokens_of_one_never_preempted(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """In-process scheduler with a draft on a live vqpoold of 32 blocks (16 per stream):
    another session holds all but 2 blocks per stream, so the request is admitted, then its
    growth is refused while it fits the pool alone: it is preempted and waits. Once the other
    session frees its blocks it resumes; its tokens and logprobs are those of a run on a big
    pool that was never preempted."""
    model, draft = load_model("builtin:llama").model, load_model("builtin:qwen3").model
    prompt, n = [1 + (j * 5) % 200 for j in range(10)], 100

    pools: list[PoolClient] = []

    def start(daemon: DaemonProcess, name: str) -> tuple[Scheduler, GenerationJob]:
        pool, source = open_pool(str(daemon.run_dir), name, model, 5.0, draft_model=draft)
        pools.append(pool)
        scheduler = Scheduler(
            model,
            source,
            owner_prefix=name,
            eos_token_ids=frozenset(),
            max_concurrent=1,
            max_queue=4,
            queue_timeout=60.0,
            reserve="prompt",
            draft_model=draft,
        )
        job = GenerationJob(prompt, n, logprobs=True, top_logprobs=2, num_draft_tokens=3)
        scheduler.start()
        scheduler.submit(job)
        return scheduler, job

    def events(job: GenerationJob) -> tuple[list[ScoredToken], JobEnd]:
        tokens: list[ScoredToken] = []
        while not isinstance(event := job.events.get(timeout=120), JobEnd):
            assert isinstance(event, ScoredToken)
            tokens.append(event)
        return tokens, event

    big = start_daemon("--n-blocks", "1024")
    scheduler, job = start(big, "big")
    try:
        reference, _ = events(job)
    finally:
        scheduler.stop()
    assert len(reference) == n

    small = start_daemon("--n-blocks", "32")
    filler_pool, _ = open_pool(str(small.run_dir), "filler", model, 5.0)
    filler = make_pooled_cache(model, filler_pool, owner="filler")
    filler.sequence.reserve_exactly(14)  # 14 of each stream's 16 blocks: 2 left (32 slots)
    scheduler, job = start(small, "small")
    try:
        deadline = time.monotonic() + 60
        while scheduler.stats.snapshot()["preemptions"] == 0:  # the premise, waited for
            assert time.monotonic() < deadline, scheduler.stats.snapshot()
            time.sleep(0.02)
        filler.release()
        tokens, end = events(job)
    finally:
        scheduler.stop()
        for pool in [*pools, filler_pool]:
            pool.close()
    assert (end.finish_reason, end.detail, end.completion_tokens) == ("length", None, n)
    assert [t.token for t in tokens] == [t.token for t in reference]
    assert [t.logprob for t in tokens] == [t.logprob for t in reference]
    assert [t.top for t in tokens] == [t.top for t in reference]
    assert small.audit()["blocks_in_use"] == 0
