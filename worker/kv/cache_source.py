"""Where a request's KV cache comes from: the shared pool, or stock mlx-lm caches (``--no-pool``).

The scheduler drives both through the same calls, so the benchmark's baseline runs the same code
path as the pooled worker, minus the pool. Requests decode together in one batch (mlx-lm's
``GenerationBatch``): a request's own cache is made by ``open`` and merged into the batch by
mlx-lm (``merge`` / ``extend`` of the per-layer caches):

* ``open(owner)``: a fresh per-request, per-layer cache list (pooled: ``PooledRowCache`` over the
  request's own ``RowBlocks``; stock: ``KVCache``), merged into a batch cache when it joins.
* ``reserve(cache, n_tokens)``: make sure the request's first ``n_tokens`` slots are backed
  before its prefill starts (pooled: blocks from the pool, ``BlockPoolExhaustedError`` when it
  has too few, nothing changed; stock: nothing to do).
* ``grow(batch_cache, n_slots, deadline, reclaim)``: before a batched step, make the batch's
  buffers cover ``n_slots`` slots; returns the rows the pool could not grow (pooled: see
  ``worker/kv/batch_cache.py``; stock: ``BatchKVCache`` grows inside the step, nothing to do).
  With a ``deadline`` (monotonic) a growth may wait at the daemon until then; ``growth_wait``
  is the seconds a step may spend so (0 without a daemon). Not ``reclaim``: free memory only
  (a growth ahead of need leaves the prompt cache alone).
* ``release(cache)``: give everything back (pooled: ``free_all``); the request's row of a batch
  is released when the batch drops it.
* ``n_blocks()`` / ``nbytes()``: what this worker holds now, for its stats.
* ``report_load(running, queued, preemptions)``: the requests running and queued now, and the
  preemptions so far (pooled: told to the daemon, which shows them in ``vqpoolctl watch`` and
  its reclaim metrics; stock: nobody to tell).
* ``held_bytes()``: the bytes the daemon counts against this worker (pooled on a daemon: its
  client's ``held_bytes``; else 0), what a reclaim ask is measured in.

A source whose pool is the daemon (``waits``) also splits ``reserve`` so that admission can wait
at the daemon off the generation thread: ``take(cache, n_tokens, wait)`` (the pool call, any
thread, may wait ``wait`` seconds in the daemon's fair queue) and ``adopt(cache, n_tokens,
taken)`` (on the generation thread), where setting ``take``'s ``cancel`` event gives the wait
up (the daemon cancels the parked request); and ``never_fits(n_tokens)`` says why a request of
``n_tokens`` can never fit the model's share of the daemon's budget (None if it may).

``fits_alone(n_tokens)`` says whether one sequence of ``n_tokens`` could ever hold its blocks
(within the pool's blocks and the model's share of the budget): a request the pool refuses to
grow while it runs alone is preempted and waits when it could, and ends when it never can.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
from vqpool.shared.allocator import Owner
from vqpool.shared.byte_sizes import format_bytes
from vqpool.shared.errors import DaemonUnavailableError, UnknownOpError
from vqpool.shared.kv_sequence import SequenceQuantization
from vqpool.shared.pool import BlockPool
from vqpool.worker.defaults import (
    DEFAULT_GROWTH_WAIT,
    DEFAULT_PREFILL_STEP_SIZE,
    MAX_GROWTH_WAIT,
)
from vqpool.worker.kv.batch_cache import (
    PooledBatch,
    PooledRowCache,
    RowBlocks,
    batch_of,
    make_row_cache,
    quantize_when_due,
)
from vqpool.worker.kv.disk_writer import DiskWriter
from vqpool.worker.kv.kv_probe import unpoolable_reason
from vqpool.worker.kv.prompt_cache import PromptCache
from vqpool.worker.kv.quantized import KVQuantization, QuantizedBlockStorage, QuantizedKVLayout
from vqpool.worker.kv.storage import KVLayout, MLXBlockStorage
from vqpool.worker.pool.client import PoolClient


class CacheSource(Protocol):
    """Per-request KV caches for one model (see the module docstring)."""

    @property
    def pooled(self) -> bool: ...

    def open(self, owner: str) -> list[Any]: ...

    def reserve(self, cache: list[Any], n_tokens: int) -> None: ...

    @property
    def growth_wait(self) -> float: ...

    def grow(
        self,
        batch_cache: list[Any],
        n_slots: int,
        deadline: float | None = None,
        reclaim: bool = True,
    ) -> list[int]: ...

    def release(self, cache: list[Any]) -> None: ...

    def n_blocks(self) -> int: ...

    def nbytes(self) -> int: ...

    def report_load(self, running: int, queued: int, preemptions: int) -> None: ...

    def held_bytes(self) -> int: ...

    @property
    def waits(self) -> bool: ...

    def take(
        self, cache: list[Any], n_tokens: int, wait: float, cancel: threading.Event | None = None
    ) -> Any: ...

    def adopt(self, cache: list[Any], n_tokens: int, taken: Any) -> None: ...

    def free_taken(self, taken: Any) -> None: ...

    def never_fits(self, n_tokens: int) -> str | None: ...

    def fits_alone(self, n_tokens: int) -> bool: ...


class PooledCacheSource:
    """Pooled caches of one model on ``pool``: each request's blocks are its own
    (:class:`RowBlocks`), and the batches they join are counted here."""

    pooled = True

    def __init__(
        self,
        model: nn.Module,
        pool: BlockPool,
        growth_wait: float = DEFAULT_GROWTH_WAIT,
        quantization: KVQuantization | None = None,
        prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
    ) -> None:
        """Raises ValueError for a model the pooled cache cannot serve (checked here, at start-up,
        rather than at each request), a ``growth_wait`` (seconds a step's growths may wait
        at a daemon) outside 0..MAX_GROWTH_WAIT, or a ``quantization`` (``--kv-bits``) the
        model's head dimensions do not allow.

        ``prefill_step_size``: the scheduler's prefill chunk. With ``--kv-bits`` and
        ``--quantized-kv-start`` 0 a request's blocks are quantized from its admission on,
        and it holds full-precision blocks for its first pass only, at most one chunk
        (:class:`RowBlocks`'s first-pass blocks)."""
        reason = unpoolable_reason(make_prompt_cache(model))
        if reason is not None:
            raise ValueError(reason)
        if not 0.0 <= growth_wait <= MAX_GROWTH_WAIT:
            raise ValueError(
                f"growth wait must be in 0..{MAX_GROWTH_WAIT:g} seconds, got {growth_wait!r}"
            )
        self._growth_wait = growth_wait
        self.model = model
        self.pool = pool
        layout = KVLayout.from_model(model, block_size=pool.config.block_size)
        self.layout = layout
        self.quantized: QuantizedKVLayout | None = (
            None if quantization is None else quantization.layout(layout)
        )
        """The layout requests' caches convert to (``--kv-bits``); None: full precision."""
        self.first_pass_slots = (
            0
            if quantization is None
            else SequenceQuantization.of(quantization.start, prefill_step_size).first_pass_slots
        )
        """Slots of a request's first-pass blocks (0: none; see :class:`RowBlocks`)."""
        self._rows: dict[Owner, RowBlocks] = {}
        self.reclaim: Callable[[int], int] | None = None
        """Given to every request's blocks (:attr:`RowBlocks.reclaim`): the worker's prompt
        cache, whose memory goes first when an allocation is refused."""
        self._batches: weakref.WeakSet[PooledBatch] = weakref.WeakSet()

    def attach_prompt_cache(
        self,
        *,
        owner_prefix: str,
        max_bytes: int,
        report: Callable[[dict[str, int]], None] | None = None,
        lost_owners: Callable[[], Mapping[Any, str]] | None = None,
        disk: DiskWriter | None = None,
    ) -> PromptCache:
        """A prompt cache for this model's requests, its entries in a storage of their own
        (requests' memory is the batch buffers), whose memory goes first when an allocation of
        a request is refused (:attr:`reclaim`)."""
        separate_kv = self.pool.config.separate_kv
        storage = MLXBlockStorage(self.layout, separate_kv=separate_kv)
        cache = PromptCache(
            self.pool,
            storage,
            quantized_storage=(
                None
                if self.quantized is None
                else QuantizedBlockStorage(self.quantized, separate_kv=separate_kv)
            ),
            owner_prefix=owner_prefix,
            max_bytes=max_bytes,
            report=report,
            lost_owners=lost_owners,
            disk=disk,
        )
        self.reclaim = cache.release_bytes
        return cache

    def open(self, owner: str) -> list[Any]:
        """The seam where a request's cache is made before it joins the batch: empty, over
        the request's own pool owner (its blocks come with ``reserve`` or ``take``)."""
        row = RowBlocks(self.pool, owner, self.layout, self.quantized, self.first_pass_slots)
        row.reclaim = self.reclaim
        row.flag_growth = self.waits
        self._rows[owner] = row
        return make_row_cache(row)

    def reserve(self, cache: list[Any], n_tokens: int) -> None:
        _row(cache).reserve(n_tokens)

    @property
    def growth_wait(self) -> float:
        """Seconds a step's growths may wait at the daemon (0 for an in-process pool)."""
        return self._growth_wait if self.waits else 0.0

    def grow(
        self,
        batch_cache: list[Any],
        n_slots: int,
        deadline: float | None = None,
        reclaim: bool = True,
    ) -> list[int]:
        batch = batch_of(batch_cache)
        assert batch is not None, "a pooled source's batch is a PooledBatchKVCache"
        self._batches.add(batch)
        quantize_when_due(batch_cache)
        return batch.ensure(n_slots, deadline, reclaim)

    def release(self, cache: list[Any]) -> None:
        row = _row(cache)
        self._rows.pop(row.owner, None)
        row.release()

    def n_blocks(self) -> int:
        """Block ids this worker's requests hold (K and V counted apart, as the daemon does)."""
        return sum(row.n_block_ids for row in self._rows.values())

    def block_bytes(self) -> int:
        """Bytes the blocks of this worker's requests stand for, each block priced by its
        format (full precision, or quantized once its request converted)."""
        return sum(row.block_bytes for row in self._rows.values())

    def nbytes(self) -> int:
        """Bytes of the batch buffers (never more than :meth:`block_bytes`)."""
        return sum(batch.nbytes for batch in self._batches)

    def report_load(self, running: int, queued: int, preemptions: int) -> None:
        if isinstance(self.pool, PoolClient):  # an in-process pool has no daemon to tell
            self.pool.report_load(running, queued, preemptions)

    def held_bytes(self) -> int:
        return self.pool.held_bytes() if isinstance(self.pool, PoolClient) else 0

    @property
    def waits(self) -> bool:
        """Whether allocations can wait at a daemon (an in-process pool cannot)."""
        return isinstance(self.pool, PoolClient)

    def take(
        self, cache: list[Any], n_tokens: int, wait: float, cancel: threading.Event | None = None
    ) -> Any:
        if cancel is None or not isinstance(self.pool, PoolClient):
            return _row(cache).take(n_tokens, wait)
        with self.pool.cancellable(cancel):  # set: the daemon stops the wait (cancel op)
            return _row(cache).take(n_tokens, wait)

    def adopt(self, cache: list[Any], n_tokens: int, taken: Any) -> None:
        _row(cache).adopt(n_tokens, taken)

    def free_taken(self, taken: Any) -> None:
        """Give back blocks :meth:`take` returned that nobody will adopt (their job went away)."""
        if taken is not None:
            # (K, V) blocks, then first-pass (K, V) ones if any; K and V are one list when a
            # "kv" block holds both.
            held = {id(b): b for blocks in taken for b in blocks}
            self.pool.free(list(held.values()))

    def fits_alone(self, n_tokens: int) -> bool:
        """Whether one sequence of ``n_tokens`` fits the pool's blocks per stream (its most
        when it grows) and the model's share of the budget."""
        config = self.pool.config
        most = config.max_blocks if config.grow_on_exhaustion else config.n_blocks
        if most is not None:
            per_stream = most // len(config.streams)
            if -(-n_tokens // config.block_size) > per_stream:
                return False
        return self.never_fits(n_tokens) is None

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
        need = answer["need"]  # a quantizing worker's sequence priced as its hello said
        limit = answer["limit"]
        return (
            f"the request can never fit: prompt + max_tokens = {n_tokens} tokens need "
            f"{format_bytes(need)} of KV cache ({need} bytes), and model "
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

    def __init__(self, model: nn.Module, draft_model: nn.Module | None = None) -> None:
        """``draft_model``: a request's cache is the model's layer caches, then the draft
        model's (mlx-lm's convention for speculative decoding)."""
        self.model = model
        self.draft_model = draft_model
        self._live: dict[int, list[Any]] = {}
        # The layers of the batches in use (a batch's layers die with it).
        self._batch_layers: weakref.WeakSet[Any] = weakref.WeakSet()

    def open(self, owner: str) -> list[Any]:
        cache: list[Any] = make_prompt_cache(self.model)
        if self.draft_model is not None:
            cache += make_prompt_cache(self.draft_model)
        self._live[id(cache)] = cache
        return cache

    def reserve(self, cache: list[Any], n_tokens: int) -> None:
        return None  # stock caches grow on demand, bounded only by memory

    growth_wait = 0.0  # no daemon to wait at

    def grow(
        self,
        batch_cache: list[Any],
        n_slots: int,
        deadline: float | None = None,
        reclaim: bool = True,
    ) -> list[int]:
        self._batch_layers.update(batch_cache)
        return []  # BatchKVCache grows inside the step

    def release(self, cache: list[Any]) -> None:
        self._live.pop(id(cache), None)

    def n_blocks(self) -> int:
        return 0

    def nbytes(self) -> int:
        requests = sum(layer.nbytes for cache in self._live.values() for layer in cache)
        return requests + sum(layer.nbytes for layer in self._batch_layers)

    def report_load(self, running: int, queued: int, preemptions: int) -> None:
        return None  # no daemon: --no-pool

    def held_bytes(self) -> int:
        return 0  # no daemon to count them

    waits = False

    def take(
        self, cache: list[Any], n_tokens: int, wait: float, cancel: threading.Event | None = None
    ) -> Any:
        return None

    def adopt(self, cache: list[Any], n_tokens: int, taken: Any) -> None:
        return None

    def free_taken(self, taken: Any) -> None:
        return None

    def never_fits(self, n_tokens: int) -> str | None:
        return None  # no budget: bounded only by memory

    def fits_alone(self, n_tokens: int) -> bool:
        return True  # never refused: stock caches grow inside the step


def _row(cache: list[Any]) -> RowBlocks:
    first = cache[0]
    assert isinstance(first, PooledRowCache), "a pooled source's caches come from its open()"
    return first.row
