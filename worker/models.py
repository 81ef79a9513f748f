"""What ``vqpool-worker --model MODEL`` loads: a Hugging Face model, or a built-in tiny one.

* ``builtin:NAME``: a tiny random-weight model from :mod:`vqpool.worker.tiny_models` (fixed seed,
  fp32, built offline in well under a second) with the :class:`ByteTokenizer`. Only the tiny
  configs with a 256-token vocabulary qualify, so every byte is a token. They differ in
  architecture and KV layout: ``llama`` (2 KV heads of 16), ``qwen2`` (4 KV heads of 16, q/k/v
  biases), ``qwen3`` (1 KV head of 32, q/k norms).
* anything else: a Hugging Face id or local path, loaded with ``mlx_lm.load`` exactly as
  ``mlx_lm.server`` does (weights downloaded to the Hugging Face cache on first use).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.nn as nn
from vqpool.worker.tiny_models import BYTE_VOCAB, TINY_CONFIGS, build_tiny_model
from vqpool.worker.tokenizer import ByteTokenizer, HFTokenizer, ServingTokenizer

BUILTIN_PREFIX = "builtin:"


def builtin_names() -> list[str]:
    """Tiny models a byte-level tokenizer fits (vocabulary of 256)."""
    return [name for name, cfg in TINY_CONFIGS.items() if cfg["vocab_size"] == BYTE_VOCAB]


@dataclass
class LoadedModel:
    """A model ready to serve.

    Attributes:
        name: The id clients use (``builtin:llama``, ``mlx-community/...``): the ``--model``
            argument as given.
        model: The mlx-lm model.
        tokenizer: Its tokenizer.
        vocab_size: Valid token ids are ``0 .. vocab_size - 1`` (prompts given as ids are checked
            against it).
    """

    name: str
    model: nn.Module
    tokenizer: ServingTokenizer
    vocab_size: int


def load_model(spec: str, seed: int = 0) -> LoadedModel:
    """Load ``spec`` (see the module docstring); ``seed`` draws a built-in's weights.

    Raises:
        ValueError: An unknown ``builtin:`` name.
    """
    if spec.startswith(BUILTIN_PREFIX):
        name = spec.removeprefix(BUILTIN_PREFIX)
        if name not in builtin_names():
            raise ValueError(
                f"unknown built-in model {spec!r}; choose one of "
                f"{[BUILTIN_PREFIX + n for n in builtin_names()]}"
            )
        model, _ = build_tiny_model(name, seed=seed)
        return LoadedModel(spec, model, ByteTokenizer(), BYTE_VOCAB)
    from mlx_lm import load

    loaded: Any = load(spec)
    model, wrapper = loaded[0], loaded[1]
    args = getattr(model, "args", None)
    vocab_size = int(getattr(args, "vocab_size", 0) or len(wrapper))
    return LoadedModel(spec, model, HFTokenizer(wrapper), vocab_size)
