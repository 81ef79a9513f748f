"""Any attention layout: the pooled cache on tiny random models of many mlx-lm architectures.

For each architecture the KV layout is read from the tensors the model writes (a one-token
probe, :mod:`vqpool.worker.kv.kv_probe`), not from attribute names, so fused projections (phi3's
``qkv_proj``, gpt_neox's ``query_key_value``), q/k norms, partial rotary and odd head dims all
work. Each test checks the probed layout against the stock cache's real tensors, greedy tokens
(and logprobs) of the pooled cache against ``generate_step`` with ``make_prompt_cache``, and the
storage's bytes against blocks held x bytes per block. Models whose layers use another cache kind
are refused at start with one line naming the layer and its kind.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from daemon_harness import daemon_args_for, remove_tree, short_tmpdir
from mlx_lm.generate import batch_generate, generate_step
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache
from mlx_lm.utils import MODEL_REMAPPING
from serving_harness import ServingStack
from vqpool.shared import BlockPool, BlockPoolAllocator, PoolConfig
from vqpool.worker import KVLayout, PoolClient
from vqpool.worker.kv.batch_probe import batching_problem
from vqpool.worker.kv.cache import make_pooled_cache
from vqpool.worker.kv.cache_source import PooledCacheSource
from vqpool.worker.models.tiny_models import build_random_model
from vqpool.worker.sched.scheduler import GenerationJob, JobEnd, Scheduler
from vqpool.worker.testing.launch import DaemonProcess
from vqpool.worker.testing.model_dirs import write_config_dir

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "rms_norm_eps": 1e-5,
    "vocab_size": 256,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}

# Each config gives a KV layout (heads, head dim) different from its neighbours where the
# architecture allows, so a layout read wrongly fails somewhere.
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON, "model_type": "llama", "num_key_value_heads": 2},
    # mlx-lm serves mistral with its llama module (MODEL_REMAPPING): mistral's args, 8:1 GQA
    # with a head dim set apart from hidden / heads.
    "mistral": {
        **_COMMON,
        "model_type": "llama",
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "rope_theta": 1000000.0,
    },
    "qwen2": {**_COMMON, "model_type": "qwen2", "num_key_value_heads": 4},
    "qwen3": {
        **_COMMON,
        "model_type": "qwen3",
        "num_key_value_heads": 1,
        "head_dim": 32,
        "rope_theta": 1000000.0,
    },
    # Fused qkv_proj: no k_proj / v_proj attributes to read.
    "phi3": {**_COMMON, "model_type": "phi3", "num_key_value_heads": 2},
    # Head dim 24 (not hidden / heads), one KV head, tied embeddings.
    "gemma": {**_COMMON, "model_type": "gemma", "num_key_value_heads": 1, "head_dim": 24},
    "gemma2": {**_COMMON, "model_type": "gemma2", "num_key_value_heads": 2, "head_dim": 8},
    "starcoder2": {**_COMMON, "model_type": "starcoder2", "num_key_value_heads": 2},
    # Partial rotary, layer norms, biases.
    "phi": {
        **_COMMON,
        "model_type": "phi",
        "num_key_value_heads": 4,
        "partial_rotary_factor": 0.5,
        "layer_norm_eps": 1e-5,
    },
    "olmo2": {**_COMMON, "model_type": "olmo2", "num_key_value_heads": 2},
    # Fused query_key_value, a quarter of each head rotated.
    "gpt_neox": {
        **_COMMON,
        "model_type": "gpt_neox",
        "layer_norm_eps": 1e-5,
        "rotary_emb_base": 10000,
        "rotary_pct": 0.25,
    },
    "stablelm": {
        **_COMMON,
        "model_type": "stablelm",
        "num_key_value_heads": 2,
        "rope_theta": 10000.0,
        "use_qkv_bias": True,
        "partial_rotary_factor": 0.25,
        "layer_norm_eps": 1e-5,
    },
    "internlm2": {**_COMMON, "model_type": "internlm2", "num_key_value_heads": 2},
    "cohere": {**_COMMON, "model_type": "cohere", "num_key_value_heads": 2},
}

PROMPT_LEN = 40
GEN_LEN = 60
POOL_CONFIG = PoolConfig(block_size=16, n_blocks=256)


# Seeds whose greedy tokens vary (10+ distinct in GEN_LEN) where seed 0's barely do.
SEEDS: dict[str, int] = {"gemma2": 4, "gpt_neox": 1, "internlm2": 1}


@functools.cache
def tiny(arch: str, dtype: mx.Dtype = mx.float32) -> nn.Module:
    return build_random_model(CONFIGS[arch], seed=SEEDS.get(arch, 0), dtype=dtype)


def prompt_ids(n: int) -> mx.array:
    return mx.array([(i * 37 + 11) % 256 for i in range(n)])


def greedy(model: nn.Module, cache: list[Any], n_tokens: int) -> tuple[list[int], mx.array]:
    tokens: list[int] = []
    logprobs: list[mx.array] = []
    for token, lp in generate_step(
        prompt_ids(PROMPT_LEN), model, max_tokens=n_tokens, prompt_cache=cache
    ):
        tokens.append(int(token))
        logprobs.append(lp)
    return tokens, mx.stack(logprobs)


def assert_identity_and_bytes(model: nn.Module, pool: BlockPool, what: str) -> None:
    """Greedy tokens and logprobs of a pooled cache (one request, ``make_pooled_cache``) equal
    stock mlx-lm's; the storage holds exactly blocks held x bytes per block; all goes back."""
    ref_tokens, ref_lp = greedy(model, make_prompt_cache(model), GEN_LEN)
    assert len(set(ref_tokens)) >= 10, f"{what}: tokens barely vary, nothing is compared"
    cache = make_pooled_cache(model, pool, f"arch-{what}")
    storage = cache.sequence.storage
    try:
        tokens, lp = greedy(model, cache, GEN_LEN)
        assert tokens == ref_tokens, f"{what}: tokens differ from stock KVCache"
        assert mx.array_equal(lp, ref_lp).item(), f"{what}: logprobs differ from stock KVCache"
        held = pool.blocks_for(f"arch-{what}")
        assert held and storage.n_blocks == len(held)
        assert storage.nbytes == sum(storage.bytes_per_block(b.stream) for b in held)
        assert storage.nbytes == storage.expected_nbytes()
    finally:
        cache.release()
    assert pool.blocks_for(f"arch-{what}") == []
    assert storage.nbytes == 0 and storage.n_blocks == 0


# Architectures whose mlx-lm model files cannot run a batch of left-padded rows (gemma2's
# attention mask does not broadcast over its query groups; mlx-lm's batch_generate fails too).
UNBATCHABLE = {"gemma2"}


class NoEosTokenizer:
    """What ``batch_generate`` asks of a tokenizer: no EOS (every request runs to max_tokens)."""

    eos_token_ids: tuple[int, ...] = ()

    def decode(self, tokens: list[int]) -> str:
        return ""


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_batched_pooled_greedy_matches_mlx_batch_generate(arch: str) -> None:
    """The worker's batched path (its scheduler over pooled rows, left padding and requests
    leaving at different lengths) gives mlx-lm's own batched tokens on every architecture; a
    model mlx-lm cannot batch (gemma2) is found at start and decoded one request at a time,
    with the tokens of mlx-lm's single-request path."""
    model = tiny(arch)
    prompts = [[(i * 37 + j * 11 + 5) % 256 for j in range(n)] for i, n in enumerate((5, 21, 12))]
    max_tokens = [14, 8, 11]
    unbatchable = batching_problem(model)
    assert (unbatchable is not None) == (arch in UNBATCHABLE), unbatchable
    if unbatchable is None:
        reference = batch_generate(
            model, NoEosTokenizer(), prompts, max_tokens=max_tokens, return_token_ids=True
        ).token_ids
    else:
        reference = [
            [int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=m)]
            for p, m in zip(prompts, max_tokens, strict=True)
        ]
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=512))
    scheduler = Scheduler(
        model,
        PooledCacheSource(model, pool),
        owner_prefix=f"batch-{arch}",
        eos_token_ids=frozenset(),
        max_concurrent=4 if unbatchable is None else 1,
        max_queue=8,
        queue_timeout=60.0,
    )
    jobs = [GenerationJob(p, m) for p, m in zip(prompts, max_tokens, strict=True)]
    scheduler.start()
    try:
        for job in jobs:
            scheduler.submit(job)
        got = []
        for job in jobs:
            tokens: list[int] = []
            while not isinstance(event := job.events.get(timeout=60), JobEnd):
                assert isinstance(event, int)
                tokens.append(event)
            assert event.finish_reason == "length", event
            got.append(tokens)
    finally:
        scheduler.stop()
    assert got == reference, f"{arch}: batched pooled tokens differ from batch_generate"
    assert all(pool.n_free(s) == pool.n_total(s) for s in pool.streams), "blocks left held"
    pool.check_invariants()


# -- the probed layout ----------------------------------------------------------------------------


def test_mistral_is_the_llama_module_in_mlx_lm() -> None:
    assert MODEL_REMAPPING["mistral"] == "llama"


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_probed_layout_is_what_the_stock_cache_holds(arch: str) -> None:
    model = tiny(arch)
    layout = KVLayout.from_model(model, block_size=16)
    stock = make_prompt_cache(model)
    model(prompt_ids(5)[None], cache=stock)
    assert layout.n_layers == len(stock) == CONFIGS[arch]["num_hidden_layers"]
    for layer in stock:
        assert layer.keys.shape[1] == layer.values.shape[1] == layout.n_kv_heads
        assert layer.keys.shape[3] == layout.k_head_dim
        assert layer.values.shape[3] == layout.v_head_dim
        assert layer.keys.dtype == layer.values.dtype == layout.dtype == mx.float32
    assert layout.block_size == 16


@pytest.mark.parametrize("arch", ["phi3", "gemma", "gpt_neox"])
def test_probed_dtype_follows_the_weights(arch: str) -> None:
    assert KVLayout.from_model(tiny(arch, mx.bfloat16)).dtype == mx.bfloat16


# -- identity and bytes ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_pooled_greedy_matches_stock_in_process(arch: str) -> None:
    pool = BlockPoolAllocator(POOL_CONFIG)
    free = {stream: pool.n_free(stream) for stream in POOL_CONFIG.streams}
    assert_identity_and_bytes(tiny(arch), pool, arch)
    pool.check_invariants()
    assert {stream: pool.n_free(stream) for stream in POOL_CONFIG.streams} == free


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_quantized_weights_pool_with_the_dtype_they_write(arch: str) -> None:
    # mlx-community models ship 4-bit weights: keys and values come out in the scales' dtype.
    model = build_random_model(CONFIGS[arch], seed=SEEDS.get(arch, 0))
    nn.quantize(model, group_size=32, bits=4)
    assert KVLayout.from_model(model).dtype == mx.float32
    assert_identity_and_bytes(model, BlockPoolAllocator(POOL_CONFIG), f"{arch}-4bit")


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    base = short_tmpdir("vqa")
    process = DaemonProcess(base / "run", *daemon_args_for(POOL_CONFIG)).start()
    yield process
    process.stop()
    remove_tree(base)


@pytest.mark.parametrize("arch", ["phi3", "gemma", "starcoder2"])
def test_pooled_greedy_matches_stock_through_vqpoold(arch: str, daemon: DaemonProcess) -> None:
    with PoolClient(daemon.run_dir, name=f"arch-{arch}") as client:
        assert_identity_and_bytes(tiny(arch), client, arch)
    daemon.audit()
    assert daemon.admin("stats")["stats"]["blocks_in_use"] == 0


# -- refusals -------------------------------------------------------------------------------------


def _sliding_window_llama() -> nn.Module:
    return build_random_model(
        {
            **CONFIGS["llama"],
            "layer_types": ["full_attention", "sliding_attention"],
            "sliding_window": 8,
        }
    )


def _mamba() -> nn.Module:
    from mlx_lm.models import mamba

    args = {
        "model_type": "mamba",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "state_size": 4,
        "num_hidden_layers": 2,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_rank": 4,
    }
    return mamba.Model(mamba.ModelArgs.from_dict(args))


def _jamba() -> nn.Module:
    from mlx_lm.models import jamba

    args = {
        "model_type": "jamba",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "attn_layer_offset": 0,
        "attn_layer_period": 2,
        "expert_layer_offset": 1,
        "expert_layer_period": 2,
        "mamba_d_conv": 4,
        "mamba_d_state": 4,
        "mamba_expand": 2,
        "num_experts": 2,
        "num_experts_per_tok": 1,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 512,
        "vocab_size": 64,
    }
    return jamba.Model(jamba.ModelArgs.from_dict(args))


def _falcon_h1() -> nn.Module:
    from mlx_lm.models import falcon_h1

    args = {
        "hidden_size": 32,
        "head_dim": 16,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "mamba_d_head": 16,
        "mamba_d_ssm": 64,
        "mamba_d_state": 8,
        "mamba_n_heads": 4,
        "mamba_chunk_size": 16,
        "vocab_size": 64,
    }
    return falcon_h1.Model(falcon_h1.ModelArgs.from_dict(args))


def _quantized_kv_llama() -> nn.Module:
    """A llama whose caches quantize keys and values (as mlx-lm's ``kv_bits`` makes them)."""
    from mlx_lm.models import llama

    class QuantizedKVLlama(llama.Model):
        def make_cache(self) -> list[Any]:
            return [QuantizedKVCache(group_size=32, bits=8) for _ in self.layers]

    return QuantizedKVLlama(llama.ModelArgs.from_dict(CONFIGS["llama"]))


REFUSED = {
    "sliding-window": (_sliding_window_llama, "layer 1 uses RotatingKVCache (a sliding-window"),
    "mamba": (_mamba, "layer 0 uses ArraysCache (state-space/recurrent state)"),
    "jamba-hybrid": (_jamba, "layer 1 uses ArraysCache (state-space/recurrent state)"),
    "cache-list": (_falcon_h1, "layer 0 uses CacheList (several caches in one layer)"),
    "quantized-kv": (_quantized_kv_llama, "layer 0 uses QuantizedKVCache (quantized keys"),
}


def assert_one_line_refusal(message: str, says: str) -> None:
    assert "\n" not in message, message
    assert says in message, message
    assert message.endswith("run this model with --no-pool"), message


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_other_cache_kinds_are_refused_in_one_line(kind: str) -> None:
    build, says = REFUSED[kind]
    model = build()
    with pytest.raises(ValueError) as raised:
        KVLayout.from_model(model)
    assert_one_line_refusal(str(raised.value), says)
    pool = BlockPoolAllocator(POOL_CONFIG)
    with pytest.raises(ValueError) as raised:
        PooledCacheSource(model, pool)
    assert_one_line_refusal(str(raised.value), says)
    pool.check_invariants()
    assert pool.stats.n_allocations == 0


def test_layers_with_different_layouts_are_refused_naming_them() -> None:
    from mlx_lm.models import llama

    model = build_random_model(CONFIGS["llama"])
    other = llama.ModelArgs.from_dict({**CONFIGS["llama"], "num_key_value_heads": 1})
    model.model.layers[1].self_attn = llama.Attention(other)
    with pytest.raises(ValueError) as raised:
        KVLayout.from_model(model)
    message = str(raised.value)
    assert "layers [0] write 2 KV heads of dims 16/16" in message
    assert "layers [1] write 1 KV heads of dims 16/16" in message
    assert_one_line_refusal(message, "different layouts")


def test_worker_refuses_a_sliding_window_model_dir_in_one_line(daemon: DaemonProcess) -> None:
    base = short_tmpdir("vqa")
    try:
        model_args = {
            **CONFIGS["llama"],
            "layer_types": ["full_attention", "sliding_attention"],
            "sliding_window": 8,
        }
        model_dir = write_config_dir(base / "sliding", model_args)
        result = subprocess.run(
            [
                sys.executable, "-m", "vqpool.worker.serve", "--model", str(model_dir),
                "--port", "0", "--run-dir", str(daemon.run_dir),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )  # fmt: skip
    finally:
        remove_tree(base)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert_one_line_refusal(lines[0], "layer 1 uses RotatingKVCache")


def test_worker_serves_a_fused_qkv_model_dir_pooled() -> None:
    # phi3 was refused before the layout was probed (no k_proj / v_proj to read).
    from mlx_lm import generate, load

    base = short_tmpdir("vqa")
    model_dir = str(write_config_dir(base / "phi3", CONFIGS["phi3"]))
    stack = ServingStack([model_dir]).start()
    try:
        model, tokenizer = load(model_dir)
        expected = generate(model, tokenizer, "A key-value cache keeps", max_tokens=24)
        assert expected
        body = {"prompt": "A key-value cache keeps", "max_tokens": 24}
        reply = stack.complete(model_dir, body)
        assert reply.status == 200, reply
        assert reply.body["choices"][0]["text"] == expected
        stack.wait_for_no_blocks()
    finally:
        stack.stop()
        remove_tree(base)
