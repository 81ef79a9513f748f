"""Whether mlx-lm can run a model's forward pass on a batch of left-padded rows.

``vqpool-worker`` decodes its requests in one batched pass (mlx-lm's ``GenerationBatch``). Some
mlx-lm model files only work at batch size 1: gemma2, for one, reshapes its queries per KV
head group and its attention mask then no longer broadcasts over a batch of rows (mlx-lm's own
``batch_generate`` fails on it the same way). :func:`batching_problem` finds out at start-up,
with one forward pass of five left-padded rows through mlx-lm's own batch caches, built but
never evaluated (MLX checks shapes when it builds the graph), so the worker can decode such a
model one request at a time instead of failing every request that shares a batch.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

# Five rows of three tokens: a batch size unlike the head counts and token counts a model's
# attention reshapes to, so a mask that cannot follow the batch fails to broadcast instead of
# broadcasting over the wrong axis.
_LEFT_PADDING = [2, 0, 1, 0, 1]


def batching_problem(model: nn.Module) -> str | None:
    """Why ``model`` cannot decode a batch of left-padded rows, as one line; None when it can."""
    try:
        per_row = [make_prompt_cache(model) for _ in _LEFT_PADDING]
        caches = [type(layer[0]).merge(list(layer)) for layer in zip(*per_row, strict=True)]
        for cache in caches:
            cache.prepare(left_padding=_LEFT_PADDING)
        model(mx.zeros((len(_LEFT_PADDING), 3), dtype=mx.uint32), cache=caches)
    except Exception as exc:
        return (
            "mlx-lm cannot run this model on a batch of requests "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        )
    return None
