"""Where a request's KV cache comes from: the shared pool, or stock mlx-lm caches (``--no-pool``).

The scheduler drives both through the same four calls, so the benchmark's baseline runs the
same code path as the pooled worker, minus the pool:

* ``open(owner)``: a fresh per-layer cache list for one request.
* ``reserve(cache, n_tokens)``: make sure the first ``n_tokens`` slots are backed before the
  prefill starts (pooled: blocks from the pool, ``BlockPoolExhaustedError`` when it has too
  few, nothing changed; stock: nothing to do).
* ``release(cache)``: give everything back (pooled: ``free_all`` and the memory).
* ``n_blocks()`` / ``nbytes()``: what this worker holds now, for its stats.
* ``report_load(running, queued)``: the requests running and queued now (pooled: told to the
  daemon, which shows them in ``vqpoolctl watch``; stock: nobody to tell).

A source whose pool is the daemon (``waits``) also splits ``reserve`` so that admission can wait
at the daemon off the generation thread: ``take(cache, n_tokens, wait)`` (the pool call, any
thread, may wait ``wait`` seconds in the daemon's fair queue) and ``adopt(cache, n_tokens,
taken)`` (the storage half, on the generation thread); and ``never_fits(n_tokens)`` says why a
request of ``n_tokens`` can never fit the model's share of the daemon's budget (None if it may).
"""

from __future__ import annotations

from typing import Any, Protocol

import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
from vqpool.shared.byte_sizes import format_bytes
from vqpool.shared.errors import DaemonUnavailableError, UnknownOpError
from vqpool.shared.pool import BlockPool
from vqpool.worker.cache import PooledPromptCache, make_pooled_cache
from vqpool.worker.client import PoolClient
from vqpool.worker.kv_probe import unpoolable_reason
from vqpool.worker.storage import KVLayout, MLXBlockStorage


class CacheSource(Protocol):
    """Per-request KV caches for one model (see the module docstring)."""

    @property
    def pooled(self) -> bool: ...

    def open(self, owner: str) -> list[Any]: ...

    def reserve(self, cache: list[Any], n_tokens: int) -> None: ...

    def release(self, cache: list[Any]) -> None: ...

    def n_blocks(self) -> int: ...

    def nbytes(self) -> int: ...

    def report_load(self, running: int, queued: int) -> None: ...

    @property
    def waits(self) -> bool: ...

    def take(self, cache: list[Any], n_tokens: int, wait: float) -> Any: ...

    def adopt(self, cache: list[Any], n_tokens: int, taken: Any) -> None: ...

    def free_taken(self, taken: Any) -> None: ...

    def never_fits(self, n_tokens: int) -> str | None: ...


class PooledCacheSource:
    """Pooled caches of one model on ``pool``, all sharing one :class:`MLXBlockStorage` so the
    worker's blocks and bytes are counted in one place."""

    pooled = True

    def __init__(self, model: nn.Module, pool: BlockPool) -> None:
        """Raises ValueError for a model the pooled cache cannot serve (checked here, at start-up,
        rather than at each request)."""
        reason = unpoolable_reason(make_prompt_cache(model))
        if reason is not None:
            raise ValueError(reason)
        self.model = model
        self.pool = pool
        layout = KVLayout.from_model(model, block_size=pool.config.block_size)
        self.storage = MLXBlockStorage(layout, separate_kv=pool.config.separate_kv)

    def open(self, owner: str) -> list[Any]:
        return make_pooled_cache(self.model, self.pool, owner, storage=self.storage)

    def reserve(self, cache: list[Any], n_tokens: int) -> None:
        assert isinstance(cache, PooledPromptCache)
        cache.sequence.reserve(n_tokens)

    def release(self, cache: list[Any]) -> None:
        assert isinstance(cache, PooledPromptCache)
        cache.release()

    def n_blocks(self) -> int:
        """Block ids this worker holds memory for (K and V counted apart, as the daemon does)."""
        return self.storage.n_blocks

    def nbytes(self) -> int:
        return self.storage.nbytes

    def report_load(self, running: int, queued: int) -> None:
        if isinstance(self.pool, PoolClient):  # an in-process pool has no daemon to tell
            self.pool.report_load(running, queued)

    @property
    def waits(self) -> bool:
        """Whether allocations can wait at a daemon (an in-process pool cannot)."""
        return isinstance(self.pool, PoolClient)

    def take(self, cache: list[Any], n_tokens: int, wait: float) -> Any:
        assert isinstance(cache, PooledPromptCache)
        return cache.sequence.take(n_tokens, wait)

    def adopt(self, cache: list[Any], n_tokens: int, taken: Any) -> None:
        assert isinstance(cache, PooledPromptCache)
        cache.sequence.adopt(n_tokens, taken)

    def free_taken(self, taken: Any) -> None:
        """Give back blocks :meth:`take` returned that nobody will adopt (their job went away)."""
        if taken is not None:
            k_blocks, v_blocks = taken
            self.pool.free(k_blocks if v_blocks is k_blocks else [*k_blocks, *v_blocks])

    def never_fits(self, n_tokens: int) -> str | None:
        """Why a sequence of ``n_tokens`` can never fit this model's share of the budget, from
        the daemon's fit answer; None when it may (or the daemon cannot say: an older daemon,
        or none answering, leaves the decision to admission)."""
        if not isinstance(self.pool, PoolClient):
            return None
        try:
            answer = self.pool.fit(n_tokens)
        except (UnknownOpError, DaemonUnavailableError):
            return None
        if answer["verdict"] != "never":
            return None
        limit = answer["limit"]
        return (
            f"the request can never fit: prompt + max_tokens = {n_tokens} tokens need "
            f"{format_bytes(answer['need'])} of KV cache ({answer['need']} bytes), and model "
            f"{self.pool.name!r} can never hold more than "
            f"{format_bytes(answer['most_ever'])} ({answer['most_ever']} bytes; its limit "
            f"{'none' if limit is None else format_bytes(limit)}, budget "
            f"{format_bytes(answer['budget']) if answer['budget'] is not None else 'unlimited'}"
            f", other models' reserves excluded); lower max_tokens or shorten the prompt"
        )


class StockCacheSource:
    """Stock mlx-lm caches (``make_prompt_cache``): no pool, no blocks; bytes are what the live
    caches hold."""

    pooled = False

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._live: dict[int, list[Any]] = {}

    def open(self, owner: str) -> list[Any]:
        cache: list[Any] = make_prompt_cache(self.model)
        self._live[id(cache)] = cache
        return cache

    def reserve(self, cache: list[Any], n_tokens: int) -> None:
        return None  # stock caches grow on demand, bounded only by memory

    def release(self, cache: list[Any]) -> None:
        self._live.pop(id(cache), None)

    def n_blocks(self) -> int:
        return 0

    def nbytes(self) -> int:
        return sum(layer.nbytes for cache in self._live.values() for layer in cache)

    def report_load(self, running: int, queued: int) -> None:
        return None  # no daemon: --no-pool

    waits = False

    def take(self, cache: list[Any], n_tokens: int, wait: float) -> Any:
        return None

    def adopt(self, cache: list[Any], n_tokens: int, taken: Any) -> None:
        return None

    def free_taken(self, taken: Any) -> None:
        return None

    def never_fits(self, n_tokens: int) -> str | None:
        return None  # no budget: bounded only by memory
