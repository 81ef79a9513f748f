"""Quantized KV (``--kv-bits``) in the pool, through a live vqpoold: a quantized block's bytes are
the arrays' bytes and shared/kv_formats' token bytes; the pooled single-sequence cache under
mlx-lm's ``generate_step(kv_bits=...)`` and the scheduler's batch of one give the tokens and
logprobs of mlx-lm's ``QuantizedKVCache`` (4 and 8 bits, groups of 32 and 64, with and without
``--quantized-kv-start``); batched rows give the greedy tokens of the same requests alone; a
preemption, a prompt-cache hit and a daemon restart on quantized blocks give identical tokens,
and the daemon charges quantized blocks their own format's bytes; bad options fail at start."""

from __future__ import annotations

import random
import signal
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from daemon_harness import remove_tree, short_tmpdir, wait_until
from mlx_lm import load
from mlx_lm.generate import generate_step, stream_generate
from mlx_lm.models.cache import make_prompt_cache
from serving_harness import ServingStack, run_worker_until_exit
from test_preemption import run
from vqpool.shared.admin_client import AdminClient
from vqpool.shared.kv_formats import token_bytes
from vqpool.shared.kv_sequence import SequenceQuantization, sequence_bytes
from vqpool.worker.kv.cache import blocks_to_hold, make_pooled_cache
from vqpool.worker.kv.cache_source import PooledCacheSource
from vqpool.worker.kv.quantized import KVQuantization, QuantizedBlockStorage
from vqpool.worker.kv.storage import KVLayout
from vqpool.worker.models.loading import load_model
from vqpool.worker.models.memory import weights_bytes
from vqpool.worker.pool.client import PoolClient
from vqpool.worker.run_worker import open_pool
from vqpool.worker.sched.scheduler import ScoredToken
from vqpool.worker.testing.http_client import request_json, stream_events
from vqpool.worker.testing.launch import DaemonProcess, WorkerProcess
from vqpool.worker.testing.model_dirs import write_config_dir

# Head dim 64 (the built-ins' 16 and 32 are below mx.quantize's groups), bf16 as served on a Mac.
MODEL_ARGS: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
BASE = short_tmpdir("vqq")
MODEL_DIR = write_config_dir(BASE / "hd64", MODEL_ARGS, dtype=mx.bfloat16)
MODEL = load_model(str(MODEL_DIR)).model
# A draft of the same tokenizer and head, another model: some drafts rejected, their slots trimmed.
DRAFT_DIR = write_config_dir(
    BASE / "draft", {**MODEL_ARGS, "num_hidden_layers": 1}, seed=7, dtype=mx.bfloat16
)
BLOCK = 16
FORMATS = [(4, 32), (4, 64), (8, 32), (8, 64)]
START = 30  # --quantized-kv-start for the tests with one: prompts cross it in prefill or decode


def teardown_module() -> None:
    remove_tree(BASE)


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return [1 + (seed * 7 + j * 3) % 200 for j in range(n)]


def reference(
    prompt: list[int], n: int, bits: int, group_size: int, start: int, step: int = 2048
) -> list[tuple[int, mx.array]]:
    """mlx-lm's own: ``generate_step`` over stock caches it quantizes (``QuantizedKVCache``)."""
    steps = generate_step(
        mx.array(prompt),
        MODEL,
        max_tokens=n,
        prompt_cache=make_prompt_cache(MODEL),
        kv_bits=bits,
        kv_group_size=group_size,
        quantized_kv_start=start,
        prefill_step_size=step,
    )
    return [(int(token), logprobs) for token, logprobs in steps]


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    base = short_tmpdir("vqqd")
    started = DaemonProcess(base / "run", "--n-blocks", "2048").start()
    yield started
    started.stop()
    remove_tree(base)


@pytest.fixture
def session(daemon: DaemonProcess) -> Iterator[Any]:
    """``make(quantization)``: a session on the module's daemon declaring that format's bytes,
    and its cache source; closed after the test, which leaves no block behind."""
    pools: list[PoolClient] = []

    def make(quantization: KVQuantization) -> tuple[PoolClient, PooledCacheSource]:
        pool, source = open_pool(str(daemon.run_dir), "q", MODEL, 5.0, quantization=quantization)
        pools.append(pool)
        return pool, source

    yield make
    for pool in pools:
        pool.close()
    assert daemon.audit()["blocks_in_use"] == 0


# -- bytes --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("bits", "group_size"), FORMATS)
def test_a_quantized_block_holds_the_declared_bytes(bits: int, group_size: int) -> None:
    fp = KVLayout.from_model(MODEL, BLOCK)
    layout = KVQuantization(bits, group_size).layout(fp)
    per_token = token_bytes(fp.n_kv_heads, fp.k_head_dim, 0, fp.dtype.size, bits, group_size)
    assert layout.k_block_bytes == layout.v_block_bytes == 2 * BLOCK * per_token
    assert layout.format == f"q{bits}g{group_size}"
    storage = QuantizedBlockStorage(layout)
    seq = storage.open("s")
    storage.extend(seq, [1, 2, 3], [4, 5, 6])
    assert storage.nbytes == storage.expected_nbytes() == 3 * (2 * layout.k_block_bytes)
    packed, scales, biases = storage.read_block(2)["k"][0]
    assert packed.shape == (1, 1, BLOCK, 64 * bits // 32) and packed.dtype == mx.uint32
    assert scales.shape == biases.shape == (1, 1, BLOCK, 64 // group_size)
    storage.truncate(seq, 1)
    assert storage.nbytes == storage.expected_nbytes() == 2 * layout.k_block_bytes
    # A fp16 block of this model is 64 x 2 bytes per head and token: 8-bit about half, 4-bit
    # about a quarter (plus a scale and a bias per group).
    assert layout.k_block_bytes < fp.k_block_bytes * (bits + 1) // 16 + fp.k_block_bytes // 8


# -- against mlx-lm's QuantizedKVCache -----------------------------------------------------------


CASES = [(b, g, 0) for b, g in FORMATS] + [(4, 64, START), (8, 32, START)]


@pytest.mark.parametrize(("bits", "group_size", "start"), CASES)
def test_the_pooled_cache_computes_what_quantized_kv_cache_does(
    session: Any, bits: int, group_size: int, start: int
) -> None:
    pool, _ = session(KVQuantization(bits, group_size, start))
    # Several prefill chunks (16 tokens) and a prompt below START that crosses it decoding.
    for n in (20, 50):
        prompt = prompt_of(n)
        expected = reference(prompt, 24, bits, group_size, start, step=16)
        with make_pooled_cache(MODEL, pool, f"single-{n}") as cache:
            got = [
                (int(token), logprobs)
                for token, logprobs in generate_step(
                    mx.array(prompt),
                    MODEL,
                    max_tokens=24,
                    prompt_cache=cache,
                    kv_bits=bits,
                    kv_group_size=group_size,
                    quantized_kv_start=start,
                    prefill_step_size=16,
                )
            ]
            assert [t for t, _ in got] == [t for t, _ in expected]
            for (_, mine), (_, theirs) in zip(got, expected, strict=True):
                assert mx.array_equal(mine, theirs).item()
            sequence = cache.sequence
            # Converted: its blocks are of the quantized format (the fp ones went back).
            assert {b.format for b in sequence.blocks()} == {f"q{bits}g{group_size}"}
            assert sequence.storage.nbytes == sequence.storage.expected_nbytes() > 0


def run_jobs(
    source: PooledCacheSource,
    specs: Sequence[tuple[list[int], int]],
    *,
    max_concurrent: int,
    prompt_cache_bytes: int = 0,
    reserve: str = "full",
) -> tuple[list[list[ScoredToken]], dict[str, Any]]:
    """The jobs (prompt, max_tokens) submitted at once on a scheduler over ``source``: each
    one's tokens (all run to max_tokens) and the scheduler's stats."""
    prompt_cache = (
        source.attach_prompt_cache(owner_prefix="q", max_bytes=prompt_cache_bytes)
        if prompt_cache_bytes
        else None
    )
    try:
        results, _, stats = run(
            source,
            specs,
            max_concurrent=max_concurrent,
            reserve=reserve,
            model=MODEL,
            prompt_cache=prompt_cache,
        )
    finally:
        if prompt_cache is not None:
            prompt_cache.drop()
    assert all(end.finish_reason == "length" for _, end in results)
    assert source.n_blocks() == 0
    return [tokens for tokens, _ in results], stats


# Batched rows may differ from the same request alone in the logprobs' last bits: a batch's
# attention and matmuls run over (B, ...) arrays whose kernels may split and order the
# reductions differently from B = 1 (Metal picks tilings by shape), and a left-padded row's
# masked slots add exact zeros in another order. Greedy tokens must be equal; logprobs within:
BATCH_LOGPROB_ATOL = 1e-3


class RecordingSource(PooledCacheSource):
    """A pooled source recording (buffer bytes, bytes of the blocks held priced by their
    format) at each of the scheduler's memory samples: after admission and every step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.samples: list[tuple[int, int]] = []

    def nbytes(self) -> int:
        n_bytes = super().nbytes()
        self.samples.append((n_bytes, self.block_bytes()))
        return n_bytes


@pytest.mark.parametrize(
    ("bits", "group_size", "start", "lengths"),
    [(4, 64, 0, (5, 40, 23, 70)), (8, 32, 0, (5, 40, 23, 70)), (4, 32, START, (31, 40, 45, 70))],
)
def test_batched_rows_decode_as_each_request_alone(
    session: Any, bits: int, group_size: int, start: int, lengths: tuple[int, ...]
) -> None:
    # With --quantized-kv-start a batch is quantized once one of its rows is due (rows of
    # one attention pass share one format): prompts past START make every row due alone too.
    quantization = KVQuantization(bits, group_size, start)
    pool, _ = session(quantization)
    source = RecordingSource(MODEL, pool, quantization=quantization)
    specs = [(prompt_of(n, i), 20) for i, n in enumerate(lengths)]
    expected = [reference(p, n, bits, group_size, start) for p, n in specs]
    alone, _ = run_jobs(source, specs, max_concurrent=1)
    together, _ = run_jobs(source, specs, max_concurrent=len(specs))
    for one, batched, ref in zip(alone, together, expected, strict=True):
        # A batch of one is generate_step's computation: identical tokens and logprobs.
        assert [t.token for t in one] == [t for t, _ in ref]
        assert [t.logprob for t in one] == [lp[t].item() for t, lp in ref]
        assert [t.token for t in batched] == [t.token for t in one]
        for mine, theirs in zip(batched, one, strict=True):
            assert abs(mine.logprob - theirs.logprob) <= BATCH_LOGPROB_ATOL
    # The buffers never hold more bytes than the rows' blocks of their formats stand for, and
    # quantized rows hold less than full precision would.
    assert source.samples
    assert all(n_bytes <= held for n_bytes, held in source.samples)
    fp_block = source.layout.k_block_bytes
    assert source.quantized is not None and source.quantized.k_block_bytes < fp_block


@pytest.mark.parametrize("lengths", [(5, 70), (70, 5)], ids=["fp-batch", "quantized-batch"])
def test_a_row_below_the_start_shares_its_batchs_format(
    session: Any, lengths: tuple[int, int]
) -> None:
    # A 70-token prompt passes START in its own prefill; a 5-token one is still in full
    # precision when the two share a batch, whichever came first: the batch is quantized
    # (one attention pass, one format), the short row with it, and the long row decodes as
    # it does alone.
    quantization = KVQuantization(4, 64, START)
    pool, _ = session(quantization)
    source = RecordingSource(MODEL, pool, quantization=quantization)
    specs = [(prompt_of(n, i), 20) for i, n in enumerate(lengths)]
    long_row = lengths.index(70)
    alone, _ = run_jobs(source, [specs[long_row]], max_concurrent=1)
    together, _ = run_jobs(source, specs, max_concurrent=2)
    assert [t.token for t in together[long_row]] == [t.token for t in alone[0]]
    assert all(n_bytes <= held for n_bytes, held in source.samples)


@pytest.mark.parametrize("cache_bytes", [0, 1 << 20], ids=["recomputed", "prompt-cached"])
def test_a_preempted_request_on_quantized_blocks_resumes_with_identical_tokens(
    start_daemon: Any, cache_bytes: int
) -> None:
    # 8 blocks per stream: alone each fits (65 and 83 slots); together, padded to the longer
    # row, they outgrow it and the short one is preempted. Its resume recomputes its prompt
    # as its first start did (a first pass in full precision) and its generated tokens as
    # decoding them did (quantized), or reuses what the prompt cache kept of them.
    specs = [(prompt_of(5), 60), (prompt_of(23, 1), 60)]
    daemon = start_daemon("--n-blocks", "16")
    pool, source = open_pool(str(daemon.run_dir), "q", MODEL, 5.0, quantization=KVQuantization(4))
    try:
        alone, alone_stats = run_jobs(source, specs, max_concurrent=1, reserve="on-demand")
        results, stats = run_jobs(
            source, specs, max_concurrent=2, prompt_cache_bytes=cache_bytes, reserve="on-demand"
        )
    finally:
        pool.close()
    assert alone_stats["preemptions"] == 0 and stats["preemptions"] >= 1
    for tokens, ref in zip(results, alone, strict=True):
        assert [t.token for t in tokens] == [t.token for t in ref]
    assert daemon.audit()["blocks_in_use"] == 0


# -- a real worker -------------------------------------------------------------------------------


def ask(stack: ServingStack, name: str, prompt: list[int]) -> dict[str, Any]:
    reply = request_json(
        stack.url(name),
        "POST",
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 12, "logprobs": True, "return_token_ids": True},
    )
    assert reply.status == 200, reply
    choice = reply.body["choices"][0]
    return {
        "ids": choice["token_ids"],
        "logprobs": [x["logprob"] for x in choice["logprobs"]["content"]],
        "cached": reply.body["usage"]["prompt_tokens_details"]["cached_tokens"],
    }


def cache_blocks(daemon: DaemonProcess) -> dict[str, int]:
    """Block ids (K and V apart) of the prompt-cache entries, per owner."""
    return {o["owner"]: o["n_blocks"] for o in daemon.admin("owners") if "-cache-" in o["owner"]}


def held_bytes(daemon: DaemonProcess, model: str) -> int:
    (row,) = [m for m in daemon.admin("model_list")["models"] if m["model"] == model]
    held: int = row["held"]
    return held


def test_a_worker_serves_quantized_blocks_through_a_hit_and_a_daemon_restart() -> None:
    args = ["--kv-bits", "4", "--kv-group-size", "32"]
    daemon_args = ("--n-blocks", "512", "--lease", "1")
    stack = ServingStack([], daemon_args=daemon_args).start()
    try:
        stack.workers["q"] = stack.start_worker(
            str(MODEL_DIR), [*args, "--served-model-name", "q"], name="q"
        )
        prompt = [random.Random(3).randrange(1, 400) for _ in range(150)]
        baseline = ask(stack, "q", prompt)  # a miss: the whole prompt prefilled
        assert baseline["cached"] == 0
        hit = ask(stack, "q", prompt)
        assert hit["cached"] == 149 and (hit["ids"], hit["logprobs"]) == (
            baseline["ids"],
            baseline["logprobs"],
        )
        # The entry holds quantized blocks, and the ledger charges them their format's bytes
        # (once the request that just ended has given its own blocks back).
        q_block = KVQuantization(4, 32).layout(KVLayout.from_model(MODEL, BLOCK)).k_block_bytes

        def only_the_cache_charged_as_quantized() -> bool:
            blocks = sum(cache_blocks(stack.daemon).values())
            return blocks > 0 and held_bytes(stack.daemon, "q") == blocks * q_block

        wait_until(only_the_cache_charged_as_quantized, timeout=10)
        held = cache_blocks(stack.daemon)

        stack.daemon.stop(signal.SIGKILL)
        stack.daemon = DaemonProcess(stack.run_dir, *daemon_args).start()
        wait_until(lambda: not stack.daemon.admin("stats")["claims"]["active"], timeout=10)
        # The worker claimed its quantized blocks back, with their format.
        assert cache_blocks(stack.daemon) == held
        assert held_bytes(stack.daemon, "q") == sum(held.values()) * q_block
        after = ask(stack, "q", prompt)
        assert after["cached"] == 149 and after["ids"] == baseline["ids"]
        assert after["logprobs"] == baseline["logprobs"]
        stack.wait_for_no_blocks()
    finally:
        stack.stop()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kv-bits", "3"], "invalid choice: 3"),
        (["--kv-bits", "4", "--kv-group-size", "48"], "--kv-group-size must be one of"),
        (["--kv-bits", "4", "--quantized-kv-start", "-1"], "--quantized-kv-start must be >= 0"),
        (
            ["--kv-bits", "4", "--kv-group-size", "32", "--no-pool"],
            "does not divide the model's key head",
        ),
        (["--kv-bits", "4", "--draft-model", "builtin:llama"], "draft's KV in the same blocks"),
        # builtin:llama's heads are 16 wide: no group of 32 divides them.
        (["--kv-bits", "4", "--kv-group-size", "32"], "does not divide the model's key head"),
    ],
)
def test_bad_quantization_options_fail_at_start(
    daemon: DaemonProcess, args: list[str], message: str
) -> None:
    worker = run_worker_until_exit(daemon.run_dir, *args, timeout=60)
    assert worker.returncode == 2, worker.stderr
    assert message in worker.stderr
    assert "serving" not in worker.stdout


def test_a_prompt_over_the_room_in_full_precision_is_served_in_its_quantized_bytes() -> None:
    # A quantizing request holds full-precision blocks for its first forward pass only (one
    # chunk), the rest quantized from its admission on: a prompt whose full-precision bytes are
    # over the budget's room, but whose quantized bytes and one chunk fit, is served, and the
    # ledger never charges it more. The stream is held open (far more tokens than the test
    # reads) while the daemon is sampled from the request's start to its first token and after.
    chunk, n_prompt, n_held = 32, 1800, 4000
    fp = KVLayout.from_model(MODEL, BLOCK)
    q = KVQuantization(4, 64).layout(fp)
    fp_pair, q_pair = fp.k_block_bytes + fp.v_block_bytes, q.k_block_bytes + q.v_block_bytes
    n_chunk_blocks = chunk // BLOCK
    # Its most: the first pass's blocks in full precision, the rest (with the growth reserve)
    # quantized.
    most = n_chunk_blocks * fp_pair + blocks_to_hold(n_prompt + n_held, BLOCK) * q_pair
    prompt_fp = -(-n_prompt // BLOCK) * fp_pair
    assert most < prompt_fp  # the premise: the prompt alone in full precision is over the room
    room = (most + prompt_fp) // 2
    budget = weights_bytes(MODEL) + room
    stack = ServingStack([], daemon_args=("--n-blocks", "4096", "--budget", str(budget))).start()
    args = ["--kv-bits", "4", "--prefill-step-size", str(chunk), "--prompt-cache-bytes", "0"]
    samples: list[dict[str, Any]] = []
    sampling = threading.Event()

    def sample() -> None:
        admin = AdminClient(stack.run_dir, timeout=5.0)
        try:
            while sampling.is_set():
                rows = admin.call("model_list")["models"]
                samples.extend(row for row in rows if row["model"] == "q")
        finally:
            admin.close()

    try:
        stack.workers["q"] = stack.start_worker(str(MODEL_DIR), [*args, "--served-model-name", "q"])
        held_before = held_bytes(stack.daemon, "q")
        sampling.set()
        sampler = threading.Thread(target=sample)
        sampler.start()
        prompt = [random.Random(5).randrange(1, 400) for _ in range(n_prompt)]
        body = {"model": "q", "prompt": prompt, "max_tokens": n_held}
        events = stream_events(stack.url("q"), "/v1/completions", body)
        try:
            first = next(events)
            assert first["choices"][0]["text"] is not None
            # The request runs (its first token is out): its blocks are held now.
            n_before = len(samples)
            wait_until(lambda: len(samples) > n_before, timeout=10)
        finally:
            sampling.clear()
            sampler.join()
            events.close()
        kv = [s["held"] - held_before for s in samples]
        assert max(kv) > 0
        assert all(n <= most for n in kv), (max(kv), most)
        for s in samples:
            formats = s.get("formats") or {}
            fp_blocks = formats.get(fp.format, {}).get("blocks", 0)
            assert fp_blocks <= 2 * n_chunk_blocks, formats  # K and V of one chunk at most
        stack.wait_for_no_blocks()
    finally:
        sampling.clear()
        stack.stop()


def test_a_workers_fit_and_never_fits_check_count_its_first_pass_in_full_precision() -> None:
    # The worker declares at hello how it holds a sequence (first pass in full precision, one
    # chunk), and the daemon's fit prices it so: a request whose quantized blocks alone would
    # fit the model's room, but not with its first pass's full-precision ones, is refused at
    # once with the numbers.
    chunk = 256
    fp = KVLayout.from_model(MODEL, BLOCK)
    q = KVQuantization(4, 64).layout(fp)
    fp_pair, q_pair = fp.k_block_bytes + fp.v_block_bytes, q.k_block_bytes + q.v_block_bytes
    budget = weights_bytes(MODEL) + 200 * q_pair
    stack = ServingStack([], daemon_args=("--n-blocks", "4096", "--budget", str(budget))).start()
    args = ["--kv-bits", "4", "--prefill-step-size", str(chunk), "--served-model-name", "q"]
    try:
        stack.workers["q"] = stack.start_worker(
            str(MODEL_DIR), [*args, "--prompt-cache-bytes", "0"]
        )
        most = stack.daemon.admin("fit", model="q", context=BLOCK)["most_ever"]
        n_blocks = most // q_pair
        assert n_blocks * BLOCK > chunk  # the premise: longer than its first pass
        n_tokens = n_blocks * BLOCK
        answer = stack.daemon.admin("fit", model="q", context=n_tokens)
        need = sequence_bytes(n_tokens, BLOCK, fp_pair, q_pair, SequenceQuantization(0, chunk))
        assert answer["format"] == "q4g64" and answer["verdict"] == "never"
        assert answer["need"] == need > most >= n_blocks * q_pair
        body = {"model": "q", "prompt": prompt_of(20), "max_tokens": n_tokens - 20}
        reply = request_json(stack.url("q"), "POST", "/v1/completions", body)
        assert reply.status == 400, reply.body
        message = reply.body["error"]["message"]
        assert "can never fit" in message and f"({need} bytes)" in message, message
        stack.wait_for_no_blocks()
    finally:
        stack.stop()


@pytest.mark.parametrize("draft", [False, True], ids=["alone", "draft-model"])
@pytest.mark.parametrize(("bits", "group_size", "start"), [(4, 32, 0), (8, 64, 0), (4, 64, START)])
def test_no_pool_serves_kv_bits_as_mlx_lms_stream_generate(
    bits: int, group_size: int, start: int, tmp_path: Path, draft: bool
) -> None:
    # --no-pool --kv-bits: mlx-lm's own QuantizedKVCache, one request at a time, as
    # mlx_lm.server serves it; the same tokens and logprobs as stream_generate with the same
    # kv_bits (prefill chunks of 16 tokens, so that the 40-token prompt crosses START in its
    # prefill and the 7-token one in its decode).
    # With a draft model, speculative_generate_step quantizes both models' caches as
    # mlx_lm.server --kv-bits --draft-model does (rejected drafts trimmed off quantized caches).
    step = 16
    args = [
        *("--kv-bits", str(bits), "--kv-group-size", str(group_size)),
        *("--quantized-kv-start", str(start), "--prefill-step-size", str(step)),
        *(("--draft-model", str(DRAFT_DIR), "--num-draft-tokens", "3") if draft else ()),
    ]
    model, tokenizer = load(str(MODEL_DIR))
    drafting: dict[str, Any] = {}
    if draft:
        drafting = {"draft_model": load(str(DRAFT_DIR))[0], "num_draft_tokens": 3}
    worker = WorkerProcess(str(MODEL_DIR), tmp_path / "w.log", no_pool=True, args=args).start()
    try:
        for prompt in (prompt_of(40), prompt_of(7, 2)):
            body = {"prompt": prompt, "max_tokens": 32, "logprobs": True, "return_token_ids": True}
            reply = request_json(worker.url, "POST", "/v1/completions", body)
            assert reply.status == 200, reply
            choice = reply.body["choices"][0]
            got = [
                (token, entry["logprob"])
                for token, entry in zip(
                    choice["token_ids"], choice["logprobs"]["content"], strict=True
                )
            ]
            want = [
                (r.token, r.logprobs[r.token].item())
                for r in stream_generate(
                    model,
                    tokenizer,
                    prompt,
                    max_tokens=32,
                    kv_bits=bits,
                    kv_group_size=group_size,
                    quantized_kv_start=start,
                    prefill_step_size=step,
                    **drafting,
                )
            ]
            assert got == want
            # The premise: quantized KV changes the logprobs (full precision would not pass).
            full = stream_generate(
                model, tokenizer, prompt, max_tokens=32, prefill_step_size=step, **drafting
            )
            assert [(r.token, r.logprobs[r.token].item()) for r in full] != want
        assert "one request at a time" in worker.log()
    finally:
        worker.stop()
