"""Read a model's KV layout off the keys and values its layers write, whatever its attention looks
like (separate ``k_proj``/``v_proj``, a fused ``qkv_proj``, q/k norms, partial rotary, ...).

:func:`probe_kv_layout` builds one forward pass of one token with recording caches in place of
the model's own, and reads each layer's ``update_and_fetch(keys, values)`` arguments: keys
``(1, n_kv_heads, 1, k_head_dim)``, values ``(1, n_kv_heads, 1, v_head_dim)`` and their dtype
are what a cache of that layer must hold, so they are the layout. MLX knows shapes and dtypes
before it evaluates anything, and the probe never evaluates the graph it built: it costs the
Python time of one forward call, not its compute.

Only models whose ``make_prompt_cache`` gives mlx-lm's plain ``KVCache`` for every layer can be
pooled: a pooled block is a slot range of full-attention keys and values. Anything else (a
rotating sliding window, state-space or recurrent state, quantized keys, several caches per
layer, chunked attention) is refused with one line naming the first such layer, its kind and
what to run instead (:func:`unpoolable_reason`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

# What a cache kind keeps per layer, to say in a refusal why a block of slots cannot hold it.
_KIND_MEANING: dict[str, str] = {
    "RotatingKVCache": "a sliding-window cache",
    "ArraysCache": "state-space/recurrent state",
    "MambaCache": "state-space state",
    "QuantizedKVCache": "quantized keys and values",
    "CacheList": "several caches in one layer",
    "ChunkedKVCache": "chunked attention",
    "ConcatenateKVCache": "a concatenating cache",
}


@dataclass(frozen=True)
class ProbedLayout:
    """What every layer of a model writes to its KV cache per token.

    Attributes:
        n_layers: Layers, one cache each.
        n_kv_heads: Key/value heads per layer.
        k_head_dim: Size of one key head.
        v_head_dim: Size of one value head.
        dtype: Element type of the keys and values written.
    """

    n_layers: int
    n_kv_heads: int
    k_head_dim: int
    v_head_dim: int
    dtype: mx.Dtype


def unpoolable_reason(caches: Sequence[Any]) -> str | None:
    """Why a model with these stock caches (``make_prompt_cache(model)``) cannot be pooled, as
    one line naming the first layer whose cache is not a plain ``KVCache``; None if it can."""
    others = [i for i, cache in enumerate(caches) if type(cache) is not KVCache]
    if not others:
        return None
    first = others[0]
    kind = type(caches[first]).__name__
    meaning = _KIND_MEANING.get(kind)
    what = f"{kind} ({meaning})" if meaning else kind
    more = f"; {len(others)} of its {len(caches)} layers do" if len(others) > 1 else ""
    return (
        f"cannot pool this model's KV cache: layer {first} uses {what}, not mlx-lm's plain "
        f"KVCache{more}; the pooled cache holds full-attention layers only: run this model "
        "with --no-pool"
    )


class _RecordingKVCache(KVCache):
    """A stock ``KVCache`` that also records the shape and dtype of every write."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[tuple[tuple[int, ...], tuple[int, ...], mx.Dtype, mx.Dtype]] = []

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.writes.append((tuple(keys.shape), tuple(values.shape), keys.dtype, values.dtype))
        result: tuple[mx.array, mx.array] = super().update_and_fetch(keys, values)
        return result


def _layer_layout(index: int, cache: _RecordingKVCache) -> tuple[int, int, int, mx.Dtype]:
    """(n_kv_heads, k_head_dim, v_head_dim, dtype) one layer wrote in the probe's pass."""
    if len(cache.writes) != 1:
        raise ValueError(
            f"cannot pool this model's KV cache: layer {index} wrote its cache "
            f"{len(cache.writes)} times in a one-token forward pass (expected once; a layer "
            "sharing another layer's cache cannot be pooled): run this model with --no-pool"
        )
    k_shape, v_shape, k_dtype, v_dtype = cache.writes[0]
    if (
        len(k_shape) != 4
        or len(v_shape) != 4
        or k_shape[0] != 1
        or k_shape[2] != 1
        or v_shape[:3] != k_shape[:3]
        or k_dtype != v_dtype
    ):
        raise ValueError(
            f"cannot pool this model's KV cache: layer {index} wrote keys {k_shape} {k_dtype} "
            f"and values {v_shape} {v_dtype} for one token, expected (1, heads, 1, dim) of one "
            "dtype: run this model with --no-pool"
        )
    return k_shape[1], k_shape[3], v_shape[3], k_dtype


def probe_kv_layout(model: nn.Module) -> ProbedLayout:
    """The KV layout ``model`` writes, read from a one-token forward pass (never evaluated).

    Raises:
        ValueError: One line saying why the model cannot be pooled: a layer whose cache is not
            a plain ``KVCache`` (:func:`unpoolable_reason`), layers that write different
            layouts (named), a layer that writes no or several entries per token, or a forward
            pass that fails.
    """
    if not getattr(model, "layers", None):
        raise ValueError("cannot read this model's KV layout: the model has no 'layers'")
    stock = make_prompt_cache(model)
    reason = unpoolable_reason(stock)
    if reason is not None:
        raise ValueError(reason)
    n_layers = len(model.layers)
    if len(stock) != n_layers:
        raise ValueError(
            f"cannot pool this model's KV cache: it makes {len(stock)} caches for {n_layers} "
            "layers (a pooled cache has one per layer): run this model with --no-pool"
        )
    recording = [_RecordingKVCache() for _ in stock]
    try:
        model(mx.array([[0]]), cache=recording)
    except Exception as exc:
        raise ValueError(
            f"cannot read this model's KV layout: a one-token forward pass failed "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    layers = [_layer_layout(i, cache) for i, cache in enumerate(recording)]
    kinds = sorted(set(layers), key=layers.index)
    if len(kinds) > 1:
        groups = "; ".join(
            f"layers {[i for i, got in enumerate(layers) if got == kind]} write "
            f"{kind[0]} KV heads of dims {kind[1]}/{kind[2]} {kind[3]}"
            for kind in kinds
        )
        raise ValueError(
            f"cannot pool this model's KV cache: its layers write different layouts ({groups}) "
            "and a pooled block covers all layers with one: run this model with --no-pool"
        )
    n_kv_heads, k_head_dim, v_head_dim, dtype = layers[0]
    return ProbedLayout(n_layers, n_kv_heads, k_head_dim, v_head_dim, dtype)
