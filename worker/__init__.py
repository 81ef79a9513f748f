"""The worker side, by layer: ``pool`` (PoolClient, the daemon client), ``kv`` (MLX block storage
and the pooled mlx-lm KV caches), ``sched`` (the generation scheduler), ``api`` (HTTP) and
``models``; ``serve`` is the ``vqpool-worker`` command. ``testing`` holds development helpers."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from vqpool.worker.pool.client import PoolClient

if TYPE_CHECKING:
    from vqpool.worker.kv.cache import PooledKVCache, PooledPromptCache, make_pooled_cache
    from vqpool.worker.kv.storage import KVLayout, MLXBlockStorage

# Exports that import mlx (and mlx-lm, ~seconds), loaded on first use so that importing the pool
# client does not pay for them.
_MLX_EXPORTS: dict[str, str] = {
    "KVLayout": "vqpool.worker.kv.storage",
    "MLXBlockStorage": "vqpool.worker.kv.storage",
    "PooledKVCache": "vqpool.worker.kv.cache",
    "PooledPromptCache": "vqpool.worker.kv.cache",
    "make_pooled_cache": "vqpool.worker.kv.cache",
}


def __getattr__(name: str) -> Any:
    module = _MLX_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "KVLayout",
    "MLXBlockStorage",
    "PoolClient",
    "PooledKVCache",
    "PooledPromptCache",
    "make_pooled_cache",
]
