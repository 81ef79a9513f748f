"""Small Hugging Face-format model directories, built offline, for tests and benchmarks.

``mlx_lm.load(DIR)`` (and so ``vqpool-worker --model DIR`` and ``mlx_lm.server --model DIR``)
reads a directory like a downloaded model: ``config.json`` (architecture and its args, EOS id),
``model.safetensors`` (random weights, see :mod:`vqpool.worker.models.tiny_models`),
``tokenizer.json`` (a byte-level BPE trained here on a short built-in text with the ``tokenizers``
library) and
``tokenizer_config.json`` (EOS token and a chat template). The built-in models skip that path
(no tokenizer, no files); these directories exercise it without a download. Same arguments,
same files: weights and tokenizer are deterministic.

    path = write_model_dir(tmp / "llama", "llama")
    # vqpool-worker --model path, or mlx_lm.load(str(path))

From a shell, for a quick local try without a download::

    python -m vqpool.worker.testing.model_dirs /tmp/tiny-llama --arch llama
    vqpool-worker --model /tmp/tiny-llama
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from vqpool.worker.models.tiny_models import build_random_model

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [EOS_TOKEN, "<|user|>", "<|assistant|>", "<|system|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""A minimal chat template: a role token, the content and a newline per message."""

TOOL_CHAT_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
"""The extra special tokens of a tool-chat directory: mlx-lm's tokenizer finds its tool-call
markers (the ``json_tools`` parser) and thinking markers by these names."""

TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for tool in tools %}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n' }}{% endif %}{% for message in messages %}<|{{ message['role'] }}|>"
    "{% if message['role'] == 'tool' %}[{{ message['tool_call_id'] }}]{% endif %}"
    "{{ message['content'] }}{% for tool_call in message.get('tool_calls', []) %}"
    "{% set tool_call = tool_call.function %}<tool_call>"
    '{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}'
    "</tool_call>{% endfor %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "<|assistant|>{% if enable_thinking %}<think>{% endif %}{% endif %}"
)
"""A chat template that uses ``tools``, assistant ``tool_calls``, ``tool`` messages and
``enable_thinking`` (Qwen's switch: the answer starts inside ``<think>``), in the json_tools
format ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` mlx-lm infers its parser from."""

TOOL_CALL_JSON = '{"name":"get_weather", "arguments": {"city" :"Paris"}}'
"""A tool call the tool-chat tokenizer also learns (its spacing varies so that no run of
punctuation repeats): encoded, every piece of it is a different token, so a test can make a
random model write it with ``logit_bias`` and a frequency penalty that retires each token used."""

QUANT_GROUP_SIZE = 64
"""Weights per quantization group: every input dimension of the architectures here (hidden 64,
intermediate 128) is a multiple of it."""

VOCAB_SIZE = 512
"""BPE vocabulary trained: 256 byte tokens, the special tokens and ~250 merges."""

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}

ARCHITECTURES: dict[str, dict[str, Any]] = {
    # Grouped-query attention: 4 query heads share 2 KV heads of dim 16.
    "llama": {**_COMMON, "model_type": "llama", "num_key_value_heads": 2},
    # One KV head of dim 32, q/k norms.
    "qwen3": {
        **_COMMON,
        "model_type": "qwen3",
        "num_key_value_heads": 1,
        "head_dim": 32,
        "rope_theta": 1000000.0,
    },
    # Full multi-head attention with q/k/v biases.
    "qwen2": {**_COMMON, "model_type": "qwen2", "num_key_value_heads": 4},
}
"""The architectures :func:`write_model_dir` builds (model args apart from the vocabulary)."""

# config.json's name of each weight dtype (mlx_lm.load reads the dtype off the weights).
_TORCH_DTYPE_NAMES: dict[mx.Dtype, str] = {
    mx.float32: "float32",
    mx.float16: "float16",
    mx.bfloat16: "bfloat16",
}

_TRAINING_TEXT = """\
A key-value cache keeps the keys and values of every token a model has seen, so that each new
token attends to the past without computing it again. The cache grows with the context: one
block of sixteen token slots at a time. Two models on one machine share one pool of blocks; a
small daemon hands out block ids and takes them back when a request ends. Hello, how are you?
Say hello in five words. Why share one pool? The quick brown fox jumps over the lazy dog.
"""


def build_tokenizer_json(
    vocab_size: int = VOCAB_SIZE, extra_special_tokens: Sequence[str] = (), extra_text: str = ""
) -> str:
    """A byte-level BPE tokenizer (``tokenizer.json`` text) trained on a short built-in text
    and ``extra_text``; the special tokens take ids 0..3 (EOS is 0), then
    ``extra_special_tokens``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*SPECIAL_TOKENS, *extra_special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((_TRAINING_TEXT + extra_text).splitlines() * 4, trainer=trainer)
    text: str = tokenizer.to_str()
    return text


def write_model_dir(
    path: Path, arch: str = "llama", seed: int = 0, *, tool_chat: bool = False
) -> Path:
    """Write a loadable model directory of architecture ``arch`` at ``path`` (created if
    missing); returns ``path``. fp32 weights, a few hundred KiB in all. ``tool_chat``: the
    tokenizer has :data:`TOOL_CHAT_TOKENS`, has learnt :data:`TOOL_CALL_JSON` and the chat template
    is :data:`TOOL_CHAT_TEMPLATE`
    (mlx-lm then sees a model that calls tools and thinks).

    Raises:
        ValueError: ``arch`` is not one of :data:`ARCHITECTURES`.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {sorted(ARCHITECTURES)}")
    return write_config_dir(path, ARCHITECTURES[arch], seed, tool_chat=tool_chat)


def write_config_dir(
    path: Path,
    model_args: dict[str, Any],
    seed: int = 0,
    dtype: mx.Dtype = mx.float32,
    bits: int | None = None,
    *,
    tool_chat: bool = False,
) -> Path:
    """Write a loadable model directory at ``path`` (created if missing) for any mlx-lm
    architecture: ``model_args`` are its ``config.json`` args (``model_type`` included) apart
    from the vocabulary, which the tokenizer sets; weights are random, of ``dtype``, quantized to
    ``bits`` per weight in groups of :data:`QUANT_GROUP_SIZE` when ``bits`` is given (as
    ``mlx_lm.convert -q`` writes them: packed weights, scales and biases); ``tool_chat`` as in
    :func:`write_model_dir`. Returns ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer_json = (
        build_tokenizer_json(extra_special_tokens=TOOL_CHAT_TOKENS, extra_text=TOOL_CALL_JSON)
        if tool_chat
        else build_tokenizer_json()
    )
    vocab = json.loads(tokenizer_json)["model"]["vocab"]
    config = {
        **model_args,
        "vocab_size": len(vocab),
        "eos_token_id": vocab[EOS_TOKEN],
        "torch_dtype": _TORCH_DTYPE_NAMES[dtype],
    }
    model = build_random_model(config, seed, dtype)
    if bits is not None:
        nn.quantize(model, group_size=QUANT_GROUP_SIZE, bits=bits)
        config["quantization"] = {"group_size": QUANT_GROUP_SIZE, "bits": bits}
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "tokenizer.json").write_text(tokenizer_json)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "bos_token": None,
        "add_bos_token": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": TOOL_CHAT_TEMPLATE if tool_chat else CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m vqpool.worker.testing.model_dirs DIR --arch ARCH [--seed N]``: write a model
    directory and print the ``vqpool-worker`` line that serves it."""
    parser = argparse.ArgumentParser(
        prog="python -m vqpool.worker.testing.model_dirs",
        description=(
            "Write a small Hugging Face-format model directory (random weights, a byte-level BPE "
            "tokenizer, a chat template; a few hundred KiB, no download) that "
            "`vqpool-worker --model DIR` serves. Its answers are random text: it is for trying "
            "the serving path, not for reading."
        ),
    )
    parser.add_argument("dir", metavar="DIR", type=Path, help="directory to write (created)")
    parser.add_argument(
        "--arch",
        choices=sorted(ARCHITECTURES),
        default="llama",
        help="architecture (default: llama): one of %(choices)s",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the random weights (default: 0)"
    )
    args = parser.parse_args(argv)
    try:
        path = write_model_dir(args.dir.resolve(), args.arch, args.seed)
    except OSError as exc:
        print(f"model_dirs: cannot write {args.dir}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.arch} model directory {path}")
    print(f"serve it with: vqpool-worker --model {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
