"""What one token of a model's KV cache costs in bytes, from its config, before any process loads
it: what the front door asks the ledger for beside a model's weights (a load's KV minimum) and
what ``vqpoolctl fit`` prices a model with when no worker of it is connected.

``kv_token_bytes(spec)`` takes what ``vqpool-worker --model`` takes (a directory, a cached hub id,
``builtin:NAME``) and reads ``config.json`` (a built-in's config): every layer holds a key and a
value per KV head, ``head_dim`` elements each (``hidden_size / num_attention_heads`` when not
given), of the model's dtype (``torch_dtype``; half precision when not given), or quantized as
``vqpool-worker --kv-bits`` keeps them (:mod:`vqpool.shared.kv_formats`). It is what the
worker's probe of the model finds for the plain attention models the pool serves
(:class:`vqpool.worker.kv.storage.KVLayout`); a model of another shape fails at the worker anyway.

Unknown (None): no config to read, or a config without those fields.
"""

from __future__ import annotations

import json
from typing import Any

from vqpool.shared.kv_formats import DEFAULT_GROUP_SIZE, token_bytes
from vqpool.shared.model_weights import local_model_dir
from vqpool.shared.tiny_configs import (
    BUILTIN_PARAMETER_BYTES,
    BUILTIN_PREFIX,
    TINY_CONFIGS,
    builtin_names,
)

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
"""Bytes per element of each ``torch_dtype`` a KV cache may hold."""
DEFAULT_DTYPE_BYTES = 2
"""A config that names no dtype: half precision, as almost every published model."""


def kv_token_bytes(
    spec: str, bits: int | None = None, group_size: int = DEFAULT_GROUP_SIZE
) -> int | None:
    """Bytes of keys and values one token takes across all layers of the model ``spec`` names,
    in full precision or (``bits`` given) quantized to ``bits`` in groups of ``group_size``
    (:func:`vqpool.shared.kv_formats.token_bytes`); None when its config is unknown.

    Raises:
        ValueError: A bad bits / group_size pair, or one the model's head_dim does not divide.
    """
    config = _config_of(spec)
    if config is None:
        return None
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    if spec.startswith(BUILTIN_PREFIX):
        element = BUILTIN_PARAMETER_BYTES
    else:
        element = DTYPE_BYTES.get(str(config.get("torch_dtype")), DEFAULT_DTYPE_BYTES)
    if layers <= 0 or kv_heads <= 0 or head_dim <= 0:
        return None
    return layers * token_bytes(kv_heads, head_dim, head_dim, element, bits, group_size)


def kv_block_bytes(
    spec: str, block_size: int, bits: int | None = None, group_size: int = DEFAULT_GROUP_SIZE
) -> int | None:
    """Bytes of one block (``block_size`` tokens, the pool's) of ``spec``'s keys and values,
    full precision or quantized as :func:`kv_token_bytes`; None when unknown."""
    per_token = kv_token_bytes(spec, bits, group_size)
    return None if per_token is None else per_token * block_size


def _config_of(spec: str) -> dict[str, Any] | None:
    if spec.startswith(BUILTIN_PREFIX):
        name = spec.removeprefix(BUILTIN_PREFIX)
        return TINY_CONFIGS[name] if name in builtin_names() else None
    path = local_model_dir(spec)
    if path is None:
        return None
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config")  # multimodal configs keep the language model's apart
    return text if isinstance(text, dict) and "num_hidden_layers" in text else config
