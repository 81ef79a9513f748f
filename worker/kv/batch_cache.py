"""A batched KV cache for mlx-lm's batch generation whose memory is covered by pool blocks.

mlx-lm batches requests with ``BatchKVCache``: per layer, one ``(B, n_kv_heads, S, head_dim)``
buffer for keys and one for values, rows left-padded so every row's newest token sits at slot
``S_used - 1``. :class:`PooledBatchKVCache` is that protocol (``update_and_fetch``, ``prepare`` /
``finalize``, ``filter``, ``extend``, ``extract``, ``merge``, ``make_mask``, per-row ``offset``,
``state``, ``trim``, ``size``, ``empty``, ``nbytes``) over buffers whose every slot, padding
included, is covered by blocks the rows' pool owners hold:

* **Rows own blocks.** Row ``r`` of a batch is one request, with its own pool owner
  (:class:`RowBlocks`). Block ``j`` of row ``r`` stands for slots ``[j * block_size, (j + 1) *
  block_size)`` of row ``r`` of every layer's key buffer (a K block) or value buffer (a V block;
  one "kv" block holds both in a pool without separate streams). The buffers are ``length``
  slots long, and every row holds at least ``ceil(length / block_size)`` blocks, so the bytes of
  the buffers never exceed blocks held x bytes per block.
* **Growth happens between steps, never inside a forward pass.** :meth:`PooledBatch.ensure`
  grows every row that needs it from the pool (the missing blocks plus the reserve of
  ``worker/kv/cache.py``'s ``RESERVE_DIVISOR``), then copies each layer's buffers into longer ones
  (the copy is the batch's whole cache, once per growth; the reserve makes growth rare). A row
  the pool cannot grow is reported, not grown: the caller takes it out of the batch before the
  step. On a daemon a growth is flagged as one (``growth``: served ahead of the model's waiting
  admissions) and may wait at the daemon until a deadline the caller gives, so that the
  budget's fair queue sees it and fair-share reclaim can answer it. ``update_and_fetch``
  refuses a write past the buffers (a missed ``ensure``), so a forward pass never stops halfway
  for lack of blocks.
* **Leaving gives blocks back at once.** ``filter`` releases the rows it drops (``free_all`` of
  their owners) and, when the rows left all have left padding, cuts those slots off the front
  and gives back the blocks no longer covering slots.
* **Joining rows bring their blocks.** A request's cache before it joins is a list of
  :class:`PooledRowCache` (one per layer) over its :class:`RowBlocks`, holding blocks reserved
  at admission; ``merge`` turns such lists into a batch and ``extend`` joins two batches. Both
  need every row to cover the joined length already (``ensure`` first; they raise otherwise).

* **Quantized rows** (``--kv-bits``): a batch's buffers are quantized as mlx-lm's
  ``maybe_quantize_kv_cache`` quantizes a cache (see :class:`PooledBatch`); its layers then have
  ``bits`` and hand attention ``(packed, scales, biases)`` triples, as ``QuantizedKVCache``, and
  its rows hold blocks of the quantized format. With ``--quantized-kv-start`` 0 a row holds
  quantized blocks from its admission on, and full-precision ones for its first pass only
  (:class:`RowBlocks`' first-pass blocks).

A finished row's KV comes out with ``extract`` as a stock ``KVCache`` (a ``QuantizedKVCache``
once quantized; a detached copy, no pool blocks), as mlx-lm's ``BatchKVCache.extract`` does.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, QuantizedKVCache, create_attention_mask, dynamic_roll
from vqpool.shared.allocator import Block, Owner
from vqpool.shared.errors import BlockPoolExhaustedError
from vqpool.shared.pool import BlockPool
from vqpool.worker.kv.cache import allocate_kv_block_sets, allocate_kv_blocks, blocks_to_hold
from vqpool.worker.kv.quantized import (
    KVBuffer,
    QuantizedKVLayout,
    buffer_concatenate,
    buffer_map,
    buffer_nbytes,
    buffer_slots,
    buffer_write,
    grown,
    prefix,
)
from vqpool.worker.kv.storage import KVLayout

log = logging.getLogger("vqpool.worker")


class RowBlocks:
    """The blocks of one request (one pool owner) while it waits for, or sits in, a batch.

    Holds block ids only; the memory they cover is the request's row of the batch buffers.

    Args:
        pool: Where blocks come from.
        owner: The request's pool owner id; registered here (an id in use raises
            ``OwnerAlreadyActiveError``).
        layout: The model's KV layout (block size and format).
        quantized: The layout the request's cache converts to (``--kv-bits``).
        first_pass_slots: With ``quantized`` and ``--quantized-kv-start`` 0 (every forward
            pass but the first reads quantized KV): the most slots the request's first pass
            writes (one prefill chunk). Its blocks for those slots (the *first-pass blocks*)
            are full precision and the rest quantized from admission on; the first-pass
            blocks are traded for quantized ones once its buffers are quantized, so that the
            request never holds more than quantized blocks and one chunk of full-precision
            ones. 0: all its blocks are full precision until the buffers convert, and are
            traded then.
    """

    def __init__(
        self,
        pool: BlockPool,
        owner: Owner,
        layout: KVLayout,
        quantized: QuantizedKVLayout | None = None,
        first_pass_slots: int = 0,
    ) -> None:
        self.pool = pool
        self.owner = owner
        self.first_pass_slots = first_pass_slots if quantized is not None else 0
        self.layout: KVLayout | QuantizedKVLayout = (
            quantized if quantized is not None and self.first_pass_slots else layout
        )
        """The layout of the blocks held (and allocated next) beside the first-pass blocks:
        ``quantized`` once converted, or from the start with first-pass blocks."""
        self.fp_layout = layout
        self.quantized = quantized
        """The layout the request's cache converts to (``--kv-bits``); None: full precision."""
        pool.register_owner(owner)
        self.released = False
        # Slots reserved for the request's own tokens (admission): kept however the padding
        # around it shrinks.
        self.reserved_slots = 0
        self.batch: PooledBatch | None = None  # the batch whose buffers have a row for it
        self.reclaim: Callable[[int], int] | None = None
        """Called with the bytes a refused allocation lacks; returns the bytes it gave back to
        the pool (the worker's prompt cache frees entries, least recently used first), and the
        allocation is retried if any. None: refusals are final."""
        self.flag_growth = False
        """Whether :meth:`grow` tells the pool its allocations are growths (a daemon's budget
        serves them ahead of the model's admissions); an in-process pool takes no flag."""
        self._k_blocks: list[Block] = []
        # The same list object as _k_blocks when one "kv" block holds both.
        self._v_blocks: list[Block] = [] if pool.config.separate_kv else self._k_blocks
        # The first-pass blocks (full precision), while the buffers are: they cover the row's
        # first slots, the blocks above the slots after them.
        self._first_k: list[Block] = []
        self._first_v: list[Block] = [] if pool.config.separate_kv else self._first_k
        self.first_pass_done = not self.first_pass_slots
        """Whether the first-pass blocks went back (or never were)."""

    @property
    def n_blocks(self) -> int:
        """Blocks held per stream (first-pass blocks included)."""
        return len(self._k_blocks) + len(self._first_k)

    @property
    def n_first_pass_blocks(self) -> int:
        """First-pass (full-precision) blocks held per stream."""
        return len(self._first_k)

    @property
    def n_block_ids(self) -> int:
        """Block ids held (K and V counted apart, as the daemon counts them)."""
        return self.n_blocks * (1 if self._v_blocks is self._k_blocks else 2)

    @property
    def block_bytes(self) -> int:
        """Bytes the blocks held stand for, each priced by its format."""
        fp, layout = self.fp_layout, self.layout
        main = len(self._k_blocks) * (layout.k_block_bytes + layout.v_block_bytes)
        return main + self.n_first_pass_blocks * (fp.k_block_bytes + fp.v_block_bytes)

    @property
    def capacity(self) -> int:
        """Token slots the blocks held cover (first-pass blocks included: a full-precision
        block holds more bytes than a quantized one)."""
        return self.n_blocks * self.layout.block_size

    def covers(self, quantized_buffers: bool) -> int:
        """Token slots the row's buffers may hold: its first-pass blocks' while they are
        full precision and it has first-pass blocks, else :attr:`capacity`."""
        if not quantized_buffers and not self.first_pass_done:
            return self.n_first_pass_blocks * self.fp_layout.block_size
        return self.capacity

    def reserve(self, n_slots: int) -> None:
        """Hold blocks covering at least ``n_slots`` slots for the request's own tokens (kept
        until it ends, whatever :meth:`shrink_to` is asked).

        Raises:
            BlockPoolExhaustedError: The pool cannot give the missing blocks; nothing changed.
        """
        self.adopt(n_slots, self.take(n_slots))

    def grow(
        self, n_slots: int, wait: float = 0.0, reclaim: bool = True, fp_buffers: bool = False
    ) -> None:
        """Hold blocks covering at least ``n_slots`` slots of the batch (its padding included);
        :meth:`shrink_to` may give them back. ``wait`` > 0 may wait that long at the daemon,
        after the immediate tries (and the prompt cache's memory, unless not ``reclaim``)
        failed. ``fp_buffers``: the buffers are still full precision, and a row with first-pass
        blocks needs that many of them too (a pass before its buffers are quantized).

        Raises:
            BlockPoolExhaustedError: The pool cannot give the missing blocks; nothing changed
                (but first-pass blocks granted before).
        """
        if fp_buffers and not self.first_pass_done:
            missing = -(-n_slots // self.fp_layout.block_size) - self.n_first_pass_blocks
            if missing > 0:
                flag = self.flag_growth
                self._hold_first(
                    allocate_kv_blocks(self.pool, self.owner, self.fp_layout, missing, wait, flag)
                )
        taken = self.take(n_slots, wait, growth=True, reclaim=reclaim)
        if taken is not None:
            self._hold(taken)

    def take(
        self, n_slots: int, wait: float = 0.0, growth: bool = False, reclaim: bool = True
    ) -> tuple[list[Block], ...] | None:
        """Allocate the blocks ``n_slots`` slots still need (None when none), for :meth:`adopt`;
        any thread may call it. ``wait`` > 0 may wait that long at the daemon: an admission
        waits from its first try; a ``growth`` tries at once first, and waits only for the
        blocks it needs (no extra) once the prompt cache could not make room. Not ``reclaim``:
        the prompt cache is left alone (a growth ahead of need takes free memory only)."""
        if self.released:
            raise RuntimeError(f"RowBlocks {self.owner!r}: released; make a new one")
        bs = self.layout.block_size
        needed = -(-n_slots // bs)
        missing = needed - self.n_blocks
        # An admission of a row with first-pass blocks takes them with its own, in one call.
        first = 0
        if not growth and not self.first_pass_done and not self.n_first_pass_blocks:
            first = min(-(-min(n_slots, self.first_pass_slots) // bs), missing)
            missing -= first
        if missing <= 0 and not first:
            return None
        missing = max(missing, 0)
        flag = growth and self.flag_growth
        extra = blocks_to_hold(n_slots, bs) - needed if missing else 0
        first_wait = 0.0 if growth else wait
        try:
            return self._allocate(missing + extra, first_wait, flag, first)
        except BlockPoolExhaustedError:
            if extra:
                with contextlib.suppress(BlockPoolExhaustedError):
                    return self._allocate(missing, first_wait, flag, first)
            # Cached memory goes before a request waits, is refused or gives way.
            layout, fp = self.layout, self.fp_layout
            lacking = missing * (layout.k_block_bytes + layout.v_block_bytes)
            lacking += first * (fp.k_block_bytes + fp.v_block_bytes)
            freed = reclaim and self.reclaim is not None and self.reclaim(lacking)
            if not freed and not (growth and wait > 0):
                raise
            if freed and growth and wait > 0:
                with contextlib.suppress(BlockPoolExhaustedError):
                    return self._allocate(missing, 0.0, flag, first)
        return self._allocate(missing, wait, flag, first)

    def adopt(self, n_slots: int, taken: tuple[list[Block], ...] | None) -> None:
        """Hold the blocks :meth:`take` returned for ``n_slots`` of the request's own slots."""
        self.reserved_slots = max(self.reserved_slots, n_slots)
        if taken is not None:
            self._hold(taken)

    def _hold(self, taken: tuple[list[Block], ...]) -> None:
        k_new, v_new, *first = taken
        self._k_blocks.extend(k_new)
        if self._v_blocks is not self._k_blocks:
            self._v_blocks.extend(v_new)
        if first:
            self._hold_first((first[0], first[1]))

    def _hold_first(self, taken: tuple[list[Block], list[Block]]) -> None:
        k_new, v_new = taken
        self._first_k.extend(k_new)
        if self._first_v is not self._first_k:
            self._first_v.extend(v_new)

    def _allocate(
        self, n_blocks: int, wait: float, growth: bool = False, first: int = 0
    ) -> tuple[list[Block], ...]:
        """``n_blocks`` of the row's layout, and ``first`` first-pass blocks after them: (K,
        V) or (K, V, first K, first V), in one pool call."""
        if not first:
            return allocate_kv_blocks(self.pool, self.owner, self.layout, n_blocks, wait, growth)
        sets = [(self.layout, n_blocks)] if n_blocks else []
        sets.append((self.fp_layout, first))
        got = allocate_kv_block_sets(self.pool, self.owner, sets, wait, growth)
        main: tuple[list[Block], list[Block]] = got[0] if n_blocks else ([], [])
        return (*main, *got[-1])

    def convert(self, wait: float = 0.0) -> None:
        """Hold quantized blocks instead of full-precision ones, as many (same slots, fewer
        bytes): the full-precision blocks go back first, so a budget that held them has room.

        Raises:
            BlockPoolExhaustedError: The pool gave no quantized blocks back; the row then holds
                none (the caller takes it out of its batch, which releases it).
        """
        target = self.quantized
        if not self.first_pass_done:
            self.first_pass_done = True
            n_first = self._give_back(self._first_k, self._first_v)
            if n_first:
                self._hold(self._allocate(n_first, wait, self.flag_growth))
        if target is None or self.layout is target:
            return
        n_blocks = self._give_back(self._k_blocks, self._v_blocks)
        self.layout = target
        if n_blocks:
            self._hold(self._allocate(n_blocks, wait, self.flag_growth))

    def _give_back(self, k_blocks: list[Block], v_blocks: list[Block]) -> int:
        """Free and forget the blocks of ``k_blocks`` and ``v_blocks`` (one list when a "kv"
        block holds both); how many there were per stream."""
        n_blocks = len(k_blocks)
        held = [*k_blocks, *(() if v_blocks is k_blocks else v_blocks)]
        k_blocks.clear()
        v_blocks.clear()
        if held:
            self.pool.free(held)
        return n_blocks

    def shrink_to(self, n_slots: int) -> None:
        """Give back the blocks beyond what ``n_slots`` slots need plus the reserve (never
        those of the slots reserved for the request's own tokens)."""
        bs = self.layout.block_size
        keep = max(blocks_to_hold(n_slots, bs), -(-self.reserved_slots // bs))
        if self.released or keep >= self.n_blocks:
            return
        keep = max(keep - self.n_first_pass_blocks, 0)  # they cover the first slots
        dropped = self._k_blocks[keep:]
        if self._v_blocks is not self._k_blocks:
            dropped.extend(self._v_blocks[keep:])
            del self._v_blocks[keep:]
        del self._k_blocks[keep:]
        self.pool.free(dropped)

    def release(self) -> None:
        """Give every block back (``pool.free_all(owner)``). Idempotent."""
        if self.released:
            return
        self.released = True
        self._k_blocks.clear()
        self._v_blocks.clear()
        self._first_k.clear()
        self._first_v.clear()
        if self.batch is not None:
            self.batch.row_released()
        self.pool.free_all(self.owner)

    def __repr__(self) -> str:
        return f"RowBlocks(owner={self.owner!r}, {self.n_blocks} block(s)/stream)"


class PooledRowCache:
    """One layer of a request's cache before it joins a batch: its :class:`RowBlocks` and,
    optionally, keys and values already cached for it (``(1, n_kv_heads, offset, head_dim)``,
    or quantized triples of that many slots from a quantized prompt-cache entry), which
    :meth:`merge` copies into the batch.

    mlx-lm's batch generation merges per-request caches with ``caches[0][layer].merge(...)``.
    """

    def __init__(
        self,
        row: RowBlocks,
        layer: int,
        keys: KVBuffer | None = None,
        values: KVBuffer | None = None,
    ) -> None:
        self.row = row
        self.layer = layer
        self.keys = keys
        self.values = values

    @property
    def offset(self) -> int:
        return 0 if self.keys is None else buffer_slots(self.keys)

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return buffer_nbytes(self.keys) + buffer_nbytes(self.values)

    @property
    def state(self) -> list[KVBuffer]:
        return [] if self.keys is None or self.values is None else [self.keys, self.values]

    def update_and_fetch(self, keys: KVBuffer, values: KVBuffer) -> tuple[KVBuffer, KVBuffer]:
        """Append ``keys``/``values`` (a cached prefix a prompt cache copies in before the
        request joins a batch: full precision, or quantized triples) and return all held.
        Copies, so the source may go at once."""
        if self.keys is None or self.values is None:
            self.keys = buffer_map(mx.contiguous, keys)
            self.values = buffer_map(mx.contiguous, values)
        else:
            self.keys = buffer_concatenate([self.keys, keys], axis=2)
            self.values = buffer_concatenate([self.values, values], axis=2)
        return self.keys, self.values

    @classmethod
    def merge(cls, caches: Sequence[PooledRowCache]) -> PooledBatchKVCache:
        return PooledBatchKVCache.merge(caches)


class PooledBatch:
    """What the per-layer caches of one batch share: its rows and its per-layer buffers.

    ``keys[layer]`` / ``values[layer]`` are ``(len(rows), n_kv_heads, length, head_dim)``
    (quantized: the ``(packed, scales, biases)`` triple of that many rows and slots); every row
    covers at least ``length`` slots (module docstring).

    Quantizing (``--kv-bits``): rows whose ``quantized`` layout is set convert the whole batch
    as mlx-lm's ``maybe_quantize_kv_cache`` converts a cache after a forward pass, when its
    longest row holds ``--quantized-kv-start`` tokens or more: between passes, before the
    :meth:`ensure` of the next one (:func:`quantize_when_due`), or, for a pass with no ``ensure``
    before it, by each layer's cache when that pass writes it (the attention inputs mlx-lm's
    converted cache gives, and no pool call inside a pass). :meth:`ensure` then has the rows
    trade their full-precision blocks (or first-pass blocks) for as many quantized ones (until
    then the buffers, smaller, are still charged as full precision).
    """

    def __init__(
        self, rows: list[RowBlocks], layout: KVLayout | QuantizedKVLayout, length: int
    ) -> None:
        self.rows = rows
        for row in rows:
            row.batch = self
        self.layout = layout
        self.target = rows[0].quantized if rows else None
        self.quantize_due = False
        """Whether this pass quantizes the buffers (layer 0's cache decides for every layer)."""
        self.length = length
        self.keys: list[Any] = [self._zeros(layout.k_head_dim) for _ in range(layout.n_layers)]
        self.values: list[Any] = [self._zeros(layout.v_head_dim) for _ in range(layout.n_layers)]

    def _zeros(self, head_dim: int) -> KVBuffer:
        layout = self.layout
        if isinstance(layout, QuantizedKVLayout):
            return layout.zeros(len(self.rows), self.length, head_dim)
        return mx.zeros((len(self.rows), layout.n_kv_heads, self.length, head_dim), layout.dtype)

    @property
    def quantized(self) -> QuantizedKVLayout | None:
        """The quantized layout of the buffers; None while they are full precision."""
        layout = self.layout
        return layout if isinstance(layout, QuantizedKVLayout) else None

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers (all layers)."""
        return sum(map(buffer_nbytes, self.keys)) + sum(map(buffer_nbytes, self.values))

    @property
    def n_block_ids(self) -> int:
        """Block ids the rows hold (K and V counted apart)."""
        return sum(row.n_block_ids for row in self.rows)

    def ensure(
        self, n_slots: int, deadline: float | None = None, reclaim: bool = True
    ) -> list[int]:
        """Make the buffers at least ``n_slots`` long, every row's blocks first (and quantize
        the batch first when it is due). With a
        ``deadline`` (monotonic), a row's growth may wait at the daemon until then (the rows
        share it: the caller blocks until ``deadline`` at most, plus round trips). Not
        ``reclaim``: a refused growth does not take the prompt cache's memory.

        Returns the indices of the rows the pool could not grow; then nothing else changed
        except that rows which could grow hold their new blocks. The caller takes the failed
        rows out of the batch (``filter``) and calls again.
        """
        quantized = self.quantized
        if quantized is not None and any(
            row.layout is not quantized or not row.first_pass_done for row in self.rows
        ):
            failed = self.trade_blocks(deadline)
            if failed:
                return failed
        if n_slots <= self.length:
            return []
        failed = []
        for i, row in enumerate(self.rows):
            if row.covers(quantized is not None) < n_slots:
                wait = 0.0 if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    row.grow(n_slots, wait, reclaim, fp_buffers=quantized is None)
                except BlockPoolExhaustedError:
                    failed.append(i)
        if failed:
            return failed
        self._resize(self.covering_length())
        return []

    def trade_blocks(self, deadline: float | None = None) -> list[int]:
        """Have every row of the quantized buffers trade its full-precision blocks for
        quantized ones (a row with first-pass blocks gives them back); the rows the pool
        refused (the caller takes them out, as :meth:`ensure`'s failed rows)."""
        failed: list[int] = []
        for i, row in enumerate(self.rows):
            wait = 0.0 if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                row.convert(wait)
            except BlockPoolExhaustedError:
                failed.append(i)
        return failed

    def _resize(self, length: int) -> None:
        """Grow the buffers to ``length`` slots (a copy of each layer's keys and values)."""
        extra = length - self.length
        if extra <= 0:
            return
        self.keys = [grown(a, extra) for a in self.keys]
        self.values = [grown(a, extra) for a in self.values]
        self.length = length

    def covering_length(self) -> int:
        """The longest the buffers may be: the slots the row with the fewest blocks covers."""
        quantized = self.quantized is not None
        return min((row.covers(quantized) for row in self.rows), default=0)

    def row_released(self) -> None:
        """A row's blocks went back: once no row holds any, drop the buffers now (without
        waiting for the garbage collector to reach a batch its caller left behind)."""
        if all(row.released for row in self.rows):
            self.drop()

    def drop(self) -> None:
        """Forget rows and buffers (every row ended, or the batch joined another one)."""
        self.rows = []
        self.keys = []
        self.values = []
        self.length = 0


class PooledBatchKVCache:
    """One layer of a :class:`PooledBatch`, with mlx-lm's ``BatchKVCache`` protocol.

    Keys and values are written in place into the batch's buffers and attention reads their
    prefix up to ``_idx``, left-padded rows masked by ``make_mask``, exactly as
    ``BatchKVCache``. Batch-wide changes (rows released, blocks given back) are made by the
    last layer's call, once every layer's buffers have changed.
    """

    def __init__(self, batch: PooledBatch, layer: int, left_padding: Sequence[int]) -> None:
        self.batch = batch
        self.layer = layer
        self.left_padding = mx.array(list(left_padding))
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0
        self._right_padding: mx.array | None = None
        # Whether a row has left padding: without, a 1-token step needs no mask (as stock).
        self._padded = any(p > 0 for p in left_padding)

    @property
    def _last_layer(self) -> bool:
        return self.layer == self.batch.layout.n_layers - 1

    @property
    def _quantized(self) -> QuantizedKVLayout | None:
        """The quantized layout of this layer's buffers; None while full precision."""
        batch = self.batch
        return batch.target if isinstance(batch.keys[self.layer], tuple) else None

    @property
    def bits(self) -> int:
        """Bits per quantized value once this layer is quantized. mlx-lm's attention takes
        its quantized path for a cache with ``bits``: a full-precision layer has none
        (AttributeError, so ``hasattr`` is False)."""
        quantized = self._quantized
        if quantized is None:
            raise AttributeError("bits")
        return quantized.bits

    @property
    def group_size(self) -> int:
        """Values per scale and bias once quantized (AttributeError before, as :attr:`bits`)."""
        quantized = self._quantized
        if quantized is None:
            raise AttributeError("group_size")
        return quantized.group_size

    @property
    def keys(self) -> KVBuffer:
        buf: KVBuffer = self.batch.keys[self.layer]
        return buf

    @property
    def values(self) -> KVBuffer:
        buf: KVBuffer = self.batch.values[self.layer]
        return buf

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[KVBuffer, KVBuffer]:
        """Write ``keys``/``values`` ``(B, n_kv_heads, S, head_dim)`` at the batch's next slots
        (quantized first when the batch is, as ``QuantizedKVCache`` writes them); return every
        row's cached prefix.

        Raises:
            RuntimeError: The write goes past the buffers (``PooledBatch.ensure`` was not called
                for this step); nothing changed.
        """
        prev = self._idx
        end = prev + keys.shape[2]
        batch = self.batch
        if end > batch.length:
            raise RuntimeError(
                f"PooledBatchKVCache: a write to slots [{prev}, {end}) but the rows' blocks "
                f"cover {batch.length}; grow the batch (ensure) before the step"
            )
        target = batch.target
        if target is not None and self._quantized is None:
            if self.layer == 0:
                # One look per pass (every layer's rows hold what layer 0's do).
                batch.quantize_due = self.quantization_due()
            if batch.quantize_due:
                self._quantize_layer(target)
        slots = (Ellipsis, slice(prev, end), slice(None))
        quantized = self._quantized
        new_keys: KVBuffer = keys if quantized is None else quantized.quantize(keys)
        new_values: KVBuffer = values if quantized is None else quantized.quantize(values)
        buffer_write(batch.keys[self.layer], slots, new_keys)
        buffer_write(batch.values[self.layer], slots, new_values)
        self.offset = self.offset + keys.shape[2]
        self._idx = end
        return prefix(batch.keys[self.layer], end), prefix(batch.values[self.layer], end)

    def prepare(
        self,
        *,
        left_padding: Sequence[int] | None = None,
        lengths: Sequence[int] | None = None,
        right_padding: Sequence[int] | None = None,
    ) -> None:
        """As ``BatchKVCache.prepare``: add left padding to an empty batch, or note the right
        padding of prompts of different lengths processed together (undone by finalize)."""
        if left_padding is not None:
            if self._idx:
                raise ValueError("Left padding can only be added to an empty batch cache")
            padding = mx.array(list(left_padding))
            self.left_padding = self.left_padding + padding
            self.offset = self.offset - padding
            self._padded = self._padded or any(p > 0 for p in left_padding)
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(list(right_padding))

    def finalize(self) -> None:
        """Turn the right padding of the last prefill into left padding (rolls the rows)."""
        if self._right_padding is None:
            return
        padding = self._right_padding
        batch = self.batch
        roll = lambda part: dynamic_roll(part, padding[:, None], axis=2)  # noqa: E731
        batch.keys[self.layer] = buffer_map(roll, batch.keys[self.layer])
        batch.values[self.layer] = buffer_map(roll, batch.values[self.layer])
        self.offset = self.offset - padding
        self.left_padding = self.left_padding + padding
        self._right_padding = None
        self._padded = True

    @property
    def state(self) -> tuple[KVBuffer, KVBuffer, mx.array, mx.array]:
        batch = self.batch
        end = self._idx
        return (
            prefix(batch.keys[self.layer], end),
            prefix(batch.values[self.layer], end),
            self.offset,
            self.left_padding,
        )

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array | str | None:
        """The causal mask hiding each row's left padding; without padding, stock's mask."""
        if not self._padded:
            return create_attention_mask(
                N, offset=self._idx, return_array=return_array, window_size=window_size
            )
        return create_causal_mask(
            N, offset=self._idx, window_size=window_size, left_padding=self.left_padding
        )

    def filter(self, batch_indices: Sequence[int]) -> None:
        """Keep only the rows ``batch_indices``; the last layer's call releases the dropped
        rows' blocks, and cuts the left padding every kept row has off the front, giving back
        the blocks that no longer cover slots."""
        keep = list(batch_indices)
        batch = self.batch
        index = mx.array(keep)
        self.offset = self.offset[index]
        self.left_padding = self.left_padding[index]
        pads: list[int] = self.left_padding.tolist()  # type: ignore[assignment]
        cut = min(pads)
        self._padded = max(pads) > cut
        keys = buffer_map(lambda part: part[index], batch.keys[self.layer])
        values = buffer_map(lambda part: part[index], batch.values[self.layer])
        if cut > 0:
            # A contiguous copy: a slice would keep the cut slots' memory alive.
            keys = buffer_map(lambda part: mx.contiguous(part[..., cut:, :]), keys)
            values = buffer_map(lambda part: mx.contiguous(part[..., cut:, :]), values)
            self._idx -= cut
            self.left_padding = self.left_padding - cut
        batch.keys[self.layer] = keys
        batch.values[self.layer] = values
        if not self._last_layer:
            return
        kept = set(keep)
        dropped = [row for i, row in enumerate(batch.rows) if i not in kept]
        batch.rows = [batch.rows[i] for i in keep]
        for row in dropped:
            row.batch = None
        batch.length -= cut
        for row in dropped:
            try:
                row.release()
            except Exception as exc:
                # The row left either way; the daemon reclaims what a dead session held.
                log.warning("releasing %s failed: %s", row.owner, exc)
        for row in batch.rows:
            row.shrink_to(batch.length)

    def extend(self, other: PooledBatchKVCache) -> None:
        """Append the rows of ``other`` (this layer of another batch): both are right-aligned
        at the longer one's ``_idx``, in buffers as long as every row of both covers.

        Raises:
            ValueError: Some row does not cover the joined batch's used slots
                (``PooledBatch.ensure`` both batches first); nothing changed.
        """
        mine, theirs = self.batch, other.batch
        # Quantized and full-precision rows do not share one attention pass: the side still in
        # full precision is quantized (its rows trade their blocks at the next ensure).
        mine_q, theirs_q = self._quantized, other._quantized
        if mine_q is not None and theirs_q is None:
            other._quantize_layer(mine_q)
        elif theirs_q is not None and mine_q is None:
            self._quantize_layer(theirs_q)
        max_idx = max(self._idx, other._idx)
        length = min(mine.covering_length(), theirs.covering_length())
        if length < max_idx:
            raise ValueError(
                f"PooledBatchKVCache.extend: the joined batch uses {max_idx} slots but its rows "
                f"cover {length}; ensure both batches first"
            )

        def aligned(c: PooledBatchKVCache) -> tuple[KVBuffer, KVBuffer, mx.array]:
            left = max_idx - c._idx
            right = length - left - c._idx
            pad = [(0, 0), (0, 0), (left, right), (0, 0)]
            place = lambda part: mx.pad(part[..., : c._idx, :], pad)  # noqa: E731
            k = buffer_map(place, c.batch.keys[c.layer])
            v = buffer_map(place, c.batch.values[c.layer])
            return k, v, c.left_padding + left

        k1, v1, lp1 = aligned(self)
        k2, v2, lp2 = aligned(other)
        mine.keys[self.layer] = buffer_concatenate([k1, k2])
        mine.values[self.layer] = buffer_concatenate([v1, v2])
        self.left_padding = mx.concatenate([lp1, lp2])
        self._padded = self._padded or other._padded or self._idx != other._idx
        self.offset = mx.concatenate([self.offset, other.offset])
        self._idx = max_idx
        if self._last_layer:
            mine.rows = mine.rows + theirs.rows
            for row in theirs.rows:
                row.batch = mine
            mine.length = length
            mine.layout = mine.quantized or theirs.layout
            theirs.drop()

    def __deepcopy__(self, memo: dict[int, Any]) -> PooledBatchKVCache:
        """Refused: a copy would need blocks of its own for every row (one owner each), and
        mlx-lm's ``PromptProcessingBatch.split`` (used by its ``BatchGenerator`` when several
        prompts prefill together) copies the whole batch. ``ContinuousBatch`` prefills one
        request at a time and never copies; ``extract`` gives one row as a stock cache."""
        raise TypeError(
            "PooledBatchKVCache cannot be copied (its rows' blocks have one owner each); use "
            "extract(i) for a row's tokens as a stock KVCache"
        )

    def extract(self, idx: int) -> KVCache | QuantizedKVCache:
        """Row ``idx``'s cached tokens as a stock ``KVCache`` (a ``QuantizedKVCache`` once
        quantized): a copy holding no blocks."""
        padding: int = self.left_padding.tolist()[idx]  # type: ignore[index,assignment]
        batch = self.batch
        row = lambda part: mx.contiguous(part[idx : idx + 1, :, padding : self._idx])  # noqa: E731
        quantized = batch.quantized
        cache: KVCache | QuantizedKVCache = (
            KVCache()
            if quantized is None
            else QuantizedKVCache(group_size=quantized.group_size, bits=quantized.bits)
        )
        cache.keys = buffer_map(row, batch.keys[self.layer])
        cache.values = buffer_map(row, batch.values[self.layer])
        cache.offset = self._idx - padding
        return cache

    def quantization_due(self) -> bool:
        """Whether the batch's buffers are quantized before its next pass (after a pass that
        left its longest row holding ``--quantized-kv-start`` tokens or more); never while
        the slots used are fewer (rows hold fewer tokens)."""
        target = self.batch.target
        if target is None:
            return False
        start = target.quantization.start
        prev = self._idx
        return prev >= max(start, 1) and target.quantization.due(prev - self._min_padding())

    def _min_padding(self) -> int:
        pads: list[int] = self.left_padding.tolist()  # type: ignore[assignment]
        return min(pads)

    def _quantize_layer(self, layout: QuantizedKVLayout) -> None:
        """Quantize this layer's buffers; once the last layer is, the batch's layout is
        quantized and its next ``ensure`` has the rows trade their blocks."""
        batch = self.batch
        batch.keys[self.layer] = layout.quantize(batch.keys[self.layer])
        batch.values[self.layer] = layout.quantize(batch.values[self.layer])
        if self._last_layer:
            batch.target = layout
            batch.layout = layout

    @classmethod
    def merge(cls, caches: Sequence[PooledRowCache]) -> PooledBatchKVCache:
        """One layer of a new batch of the requests ``caches`` (one :class:`PooledRowCache` of
        this layer per request), their cached tokens right-aligned.

        mlx-lm merges layer by layer; the layers of one merge share one :class:`PooledBatch`,
        found through the first row (the merge of layer 0 makes it).

        Raises:
            ValueError: A row does not cover the merged length (reserve its blocks first).
        """
        rows = [c.row for c in caches]
        layer = caches[0].layer
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        batch = _PENDING_MERGES.get(id(rows[0]))
        if layer == 0 or batch is None or batch.rows != rows:
            # A quantized prefix (a prompt-cache entry) makes a quantized batch (its rows
            # trade their blocks at the next ensure).
            target = rows[0].quantized
            has_quantized = any(isinstance(c.keys, tuple) for c in caches)
            layout = target if target is not None and has_quantized else rows[0].fp_layout
            covered = min(row.covers(layout is target) for row in rows)
            if covered < longest:
                raise ValueError(
                    f"PooledBatchKVCache.merge: a row holds {longest} cached tokens but the "
                    f"rows' blocks cover {covered}; reserve them first"
                )
            batch = PooledBatch(rows, layout, covered)
            _PENDING_MERGES[id(rows[0])] = batch
        padding = [longest - n for n in lengths]
        cache = cls(batch, layer, padding)
        quantized = batch.quantized
        for i, (p, c) in enumerate(zip(padding, caches, strict=True)):
            if c.keys is not None and c.values is not None:
                slots = (slice(i, i + 1), slice(None), slice(p, longest))
                keys, values = c.keys, c.values
                if quantized is not None and not isinstance(keys, tuple):
                    assert not isinstance(values, tuple)
                    keys, values = quantized.quantize(keys), quantized.quantize(values)
                buffer_write(batch.keys[layer], slots, keys)
                buffer_write(batch.values[layer], slots, values)
        cache.offset = cache.offset + longest
        cache._idx = longest
        cache._padded = any(p > 0 for p in padding)
        if cache._last_layer:
            del _PENDING_MERGES[id(rows[0])]
        return cache

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self._idx == 0

    @property
    def nbytes(self) -> int:
        """Bytes of this layer's buffers."""
        return buffer_nbytes(self.keys) + buffer_nbytes(self.values)


# The batch a merge in progress builds, by the id of its first row: mlx-lm merges one layer at
# a time, and every layer of one merge must share one PooledBatch. Layer 0 adds the entry, the
# last layer removes it.
_PENDING_MERGES: dict[int, PooledBatch] = {}


def make_row_cache(row: RowBlocks) -> list[PooledRowCache]:
    """An empty per-request cache (one :class:`PooledRowCache` per layer) over ``row``."""
    return [PooledRowCache(row, layer) for layer in range(row.layout.n_layers)]


def quantize_when_due(cache: Sequence[Any]) -> None:
    """Quantize a pooled batch's buffers now, between passes, when its next pass would (as
    mlx-lm's ``maybe_quantize_kv_cache`` right after the pass that made it due: the same
    arrays), so that the ``ensure`` before that pass grows quantized buffers and the rows'
    quantized blocks rather than full-precision ones. A pass run with no ``ensure`` before it
    (the last token's, right after the last prefill chunk) quantizes them itself."""
    batch = batch_of(cache)
    if batch is None or batch.target is None or batch.quantized is not None:
        return
    if cache[0].quantization_due():
        for layer in cache:
            if layer._quantized is None:
                layer._quantize_layer(batch.target)


def batch_of(cache: Sequence[Any]) -> PooledBatch | None:
    """The :class:`PooledBatch` behind a batch's per-layer caches (None for stock caches)."""
    first = cache[0] if cache else None
    return first.batch if isinstance(first, PooledBatchKVCache) else None
