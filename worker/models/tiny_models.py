"""Small random-weight mlx-lm models, built offline with fixed seeds.

For tests, benchmarks and the built-in models of the serving worker on machines with no weights:
each name maps to an mlx-lm architecture config (:data:`vqpool.shared.tiny_configs.TINY_CONFIGS`,
shared so the front door knows their weights' bytes without MLX), built with
``Model(ModelArgs.from_dict(config))`` (no download, no tokenizer; token ids go in directly).

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
from vqpool.shared.tiny_configs import TINY_CONFIGS

# Scale applied to projection and lm_head weights so greedy tokens vary (see module docstring).
WEIGHT_SCALE: float = 3.0


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
