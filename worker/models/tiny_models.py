"""Small random-weight mlx-lm models, built offline with fixed seeds.

For tests, benchmarks and the built-in models of the serving worker on machines with no weights:
each name maps to an mlx-lm architecture config, built with ``Model(ModelArgs.from_dict(config))``
(no download, no tokenizer; token ids go in directly). The configs differ in their KV layout
(KV heads, head dim) on purpose, so a cache that gets the layout wrong fails on one of them.

mlx-lm's default random init makes a model repeat one token. Scaling every ``*proj*`` weight and
``lm_head`` by 3 makes greedy decoding produce 100+ distinct tokens in 200, so comparing two
caches token by token actually exercises the attention over the cached positions.
"""

from __future__ import annotations

import importlib
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

# Scale applied to projection and lm_head weights so greedy tokens vary (see module docstring).
WEIGHT_SCALE: float = 3.0

# Vocabulary of every built-in: 256 byte values, so a byte-level tokenizer fits the tiny models.
BYTE_VOCAB: int = 256

_TINY_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "rms_norm_eps": 1e-5,
    "vocab_size": BYTE_VOCAB,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # Grouped-query attention: 4 query heads share 2 KV heads of dim 16.
    "llama": {**_TINY_COMMON, "model_type": "llama", "num_key_value_heads": 2},
    # Full multi-head attention (4 KV heads of dim 16), with qwen2's q/k/v biases.
    "qwen2": {**_TINY_COMMON, "model_type": "qwen2", "num_key_value_heads": 4},
    # One KV head of dim 32 (head_dim set apart from hidden / heads), with qwen3's q/k norms.
    "qwen3": {
        **_TINY_COMMON,
        "model_type": "qwen3",
        "num_key_value_heads": 1,
        "head_dim": 32,
        "rope_theta": 1000000.0,
    },
    # The benchmark's larger model: 1024 hidden, 8 layers, 8 KV heads of dim 64.
    "llama-1024x8": {
        **_TINY_COMMON,
        "model_type": "llama",
        "hidden_size": 1024,
        "num_hidden_layers": 8,
        "intermediate_size": 2816,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "vocab_size": 4096,
    },
}


def tiny_model_names() -> list[str]:
    """The names :func:`build_tiny_model` accepts."""
    return list(TINY_CONFIGS)


def build_tiny_model(
    name: str, seed: int = 0, dtype: mx.Dtype = mx.float32
) -> tuple[nn.Module, dict[str, Any]]:
    """Build the named model with random weights drawn from ``seed``; returns (model, config).

    The same name, seed and dtype give bit-identical weights in every process.

    Raises:
        ValueError: ``name`` is not one of :func:`tiny_model_names`.
    """
    config = TINY_CONFIGS.get(name)
    if config is None:
        raise ValueError(f"unknown tiny model {name!r}; choose one of {tiny_model_names()}")
    return build_random_model(config, seed, dtype), dict(config)


def build_random_model(
    config: dict[str, Any], seed: int = 0, dtype: mx.Dtype = mx.float32
) -> nn.Module:
    """An mlx-lm model of architecture ``config["model_type"]`` with random weights drawn from
    ``seed`` (projections and lm_head scaled by WEIGHT_SCALE), evaluated and in eval mode."""
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    flat = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    weights = [
        (path, value * WEIGHT_SCALE if "proj" in path or path.startswith("lm_head") else value)
        for path, value in flat
    ]
    model.update(tree_unflatten(weights))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    model.eval()
    return model
