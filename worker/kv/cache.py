"""A KV cache for mlx-lm models whose memory is blocks drawn from a :class:`BlockPool`.

``make_pooled_cache(model, pool, owner)`` returns one cache per layer, usable wherever mlx-lm
takes a ``prompt_cache`` (``generate_step``, ``stream_generate``, ``generate``). The layer caches
share one :class:`PooledSequence`: a block covers ``block_size`` token slots of the sequence for
every layer, so the sequence, not each layer, talks to the pool. Its memory lives in an
:class:`~vqpool.worker.kv.storage.MLXBlockStorage`, where each block id maps to its slots.

When the pool is called (a call to a ``PoolClient`` is a round trip to the daemon):

* Growing: when a layer's write needs slots past the blocks held, the sequence allocates the
  missing blocks, plus a reserve of 1/16 of the blocks it then needs (none below 256 tokens), in
  one ``allocate_many`` (or ``allocate`` for a shared "kv" stream), then one ``mark_used_many``
  bringing the pool's per-block ``n_used`` up to date. Decode steps inside held blocks make no
  pool call. The reserve bounds the copying of a growing contiguous buffer to a constant per
  token (see docs/cache.md); if the pool cannot give it, only the missing blocks are taken.
* Trimming: once every layer is trimmed below a block boundary, blocks beyond what the sequence
  needs (plus the reserve) go back with one ``free``, and ``n_used`` is synced.
* Releasing: :meth:`PooledPromptCache.release` (or leaving its ``with`` block) calls
  ``pool.free_all(owner)`` and closes the sequence in the storage, which drops its memory. This
  is how the storage learns that the blocks are gone: always release through the cache. A
  ``free_all`` made directly on the pool leaves the storage holding memory for blocks it no
  longer has, until the cache is released.

The pool's ``n_used`` of the sequence's last blocks lags between growths (exact after each growth,
trim, :meth:`PooledSequence.sync_usage`, and release).

``copy.deepcopy`` of a layer cache (or of the whole list, as mlx-lm's server does for its prompt
cache) gives detached snapshots: stock ``mlx_lm.models.cache.KVCache`` objects holding copies of
the cached keys and values, and no pool blocks. A copy that held blocks would need its own owner
id and an explicit release, and dropping it (as an LRU prompt cache does) would leak blocks;
a snapshot cannot leak, saves with ``save_prompt_cache`` and loads with ``load_prompt_cache``.

Quantized KV (mlx-lm's ``kv_bits``): ``PooledKVCache.to_quantized`` is what mlx-lm's
``maybe_quantize_kv_cache`` calls once the sequence reaches ``quantized_kv_start`` tokens; the
first layer's call converts the whole sequence (:meth:`PooledSequence.quantize`: every layer's
keys and values quantized into a :class:`~vqpool.worker.kv.quantized.QuantizedBlockStorage`,
its full-precision blocks given back, as many blocks of the quantized format taken), and each
layer's call returns a :class:`PooledQuantizedKVCache`, which has mlx-lm's ``QuantizedKVCache``
protocol (``bits``, ``group_size``, ``(packed, scales, biases)`` keys and values), so the model's
attention takes its quantized path. ``generate_step(..., kv_bits=...)`` over a pooled cache
therefore computes what it computes over stock caches.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    KVCache,
    QuantizedKVCache,
    create_attention_mask,
    make_prompt_cache,
)
from vqpool.shared.allocator import Block, Owner
from vqpool.shared.errors import BlockPoolExhaustedError
from vqpool.shared.pool import AllocationRequest, BlockPool
from vqpool.worker.kv.kv_probe import unpoolable_reason
from vqpool.worker.kv.quantized import (
    KVQuantization,
    QuantizedBlockStorage,
    QuantizedKVLayout,
    buffer_map,
    buffer_nbytes,
    buffer_write,
    prefix,
)
from vqpool.worker.kv.storage import BlockStorage, KVLayout, MLXBlockStorage, SlotLayout

# A growing sequence also reserves 1/RESERVE_DIVISOR of the blocks it needs, so its buffers are
# copied O(1) times per RESERVE_DIVISOR blocks of growth instead of at every block boundary.
RESERVE_DIVISOR: int = 16


def blocks_to_hold(n_tokens: int, block_size: int) -> int:
    """Blocks a sequence of ``n_tokens`` holds: the blocks its tokens need plus the reserve."""
    needed = -(-n_tokens // block_size)
    return needed + needed // RESERVE_DIVISOR


def allocate_kv_blocks(
    pool: BlockPool,
    owner: Owner,
    layout: SlotLayout,
    n_blocks: int,
    wait: float = 0.0,
    growth: bool = False,
) -> tuple[list[Block], list[Block]]:
    """Take ``n_blocks`` blocks per stream for ``owner`` in one pool call, all or nothing:
    (K blocks, V blocks), or the same "kv" list twice in a pool without separate streams.
    ``wait`` > 0 may wait that long at a daemon; ``growth`` tells a daemon it grows memory
    the owner's running request holds (docs/budget.md, "Growth")."""
    (blocks,) = allocate_kv_block_sets(pool, owner, [(layout, n_blocks)], wait, growth)
    return blocks


def allocate_kv_block_sets(
    pool: BlockPool,
    owner: Owner,
    sets: Sequence[tuple[SlotLayout, int]],
    wait: float = 0.0,
    growth: bool = False,
) -> list[tuple[list[Block], list[Block]]]:
    """:func:`allocate_kv_blocks` of several ``(layout, n_blocks)`` (blocks of several formats)
    in one pool call, all or nothing (a daemon's budget sees one request): per set, (K
    blocks, V blocks)."""
    streams = ("k", "v") if pool.config.separate_kv else ("kv",)
    # Only a pool whose allocations can wait (a daemon) is given the arguments.
    waiting: dict[str, Any] = {"wait": wait} if wait > 0 else {}
    if growth:
        waiting["growth"] = True
    any_pool: Any = pool
    requests = [
        AllocationRequest(stream, n_blocks * layout.block_size, owner, layout.format)
        for layout, n_blocks in sets
        for stream in streams
    ]
    if len(requests) == 1:
        blocks = list(
            any_pool.allocate("kv", requests[0].n_tokens, owner, requests[0].format, **waiting)
        )
        return [(blocks, blocks)]
    results = any_pool.allocate_many(requests, **waiting)
    failures = [r for r in results if isinstance(r, Exception)]
    if failures:
        granted = [b for r in results if not isinstance(r, Exception) for b in r]
        if granted:
            pool.free(granted)
        raise failures[0]
    lists = [list(r) for r in results if not isinstance(r, Exception)]
    if len(streams) == 1:
        return [(blocks, blocks) for blocks in lists]
    return list(zip(lists[::2], lists[1::2], strict=True))


class PooledSequence:
    """One sequence's pool blocks and storage buffers, shared by its per-layer caches.

    Args:
        pool: Where blocks come from (a ``BlockPoolAllocator`` or a ``PoolClient``).
        owner: The pool owner id of this sequence; registered here, so an id in use raises
            ``OwnerAlreadyActiveError``.
        storage: Holds the memory; its layout and stream split must match the pool's.
    """

    def __init__(self, pool: BlockPool, owner: Owner, storage: BlockStorage) -> None:
        config = pool.config
        if storage.layout.block_size != config.block_size:
            raise ValueError(
                f"PooledSequence: storage block size {storage.layout.block_size} != pool block "
                f"size {config.block_size}"
            )
        if storage.separate_kv != config.separate_kv:
            raise ValueError(
                f"PooledSequence: storage separate_kv={storage.separate_kv} but pool "
                f"separate_kv={config.separate_kv}"
            )
        self.pool = pool
        self.owner = owner
        self.storage = storage
        self.layout = storage.layout
        self.quantized_storage: QuantizedBlockStorage | None = None
        """Where :meth:`quantize` moves the sequence (a worker's shared one; None: its own)."""
        self.buffers = storage.open(owner)
        try:
            pool.register_owner(owner)
        except BaseException:
            storage.close(self.buffers)
            raise
        self.offsets = [0] * self.layout.n_layers
        self.capacity = 0  # token slots of the blocks held
        self.released = False
        self._k_blocks: list[Block] = []
        # The same list object as _k_blocks when one "kv" block holds both.
        self._v_blocks: list[Block] = [] if config.separate_kv else self._k_blocks
        # n_used the pool has for block index i (as last allocated or marked).
        self._pool_n_used: list[int] = []
        self._synced_tokens = 0

    @property
    def n_tokens(self) -> int:
        """Tokens the sequence holds: the longest layer's offset."""
        return max(self.offsets)

    @property
    def n_blocks(self) -> int:
        """Blocks held per stream."""
        return len(self._k_blocks)

    def blocks(self) -> list[Block]:
        """Every block the sequence holds (K then V blocks, or the "kv" blocks)."""
        if self._v_blocks is self._k_blocks:
            return list(self._k_blocks)
        return self._k_blocks + self._v_blocks

    # -- growth ----------------------------------------------------------------------------------

    def reserve(self, n_slots: int) -> None:
        """Hold blocks for at least ``n_slots`` token slots. On error nothing has changed.

        Raises:
            BlockPoolExhaustedError: The pool cannot give the missing blocks.
            RuntimeError: The sequence was released.
        """
        self.adopt(n_slots, self.take(n_slots))

    def take(self, n_slots: int, wait: float = 0.0) -> tuple[list[Block], list[Block]] | None:
        """The pool half of :meth:`reserve`: allocate the blocks ``n_slots`` slots still need
        (None when none) without touching the storage, so another thread may make this call
        (and wait in it) while the sequence is not in use. Give the result to :meth:`adopt`, or
        free it. ``wait`` > 0 needs a pool whose allocations can wait (``PoolClient``): the
        request may wait that many seconds at the daemon for its model's share of the budget.

        Raises:
            BlockPoolExhaustedError: The pool cannot give the missing blocks (in ``wait``).
            RuntimeError: The sequence was released.
        """
        if self.released:
            raise RuntimeError(
                f"PooledSequence {self.owner!r}: the cache was released; make a new one"
            )
        bs = self.layout.block_size
        needed = -(-n_slots // bs)
        missing = needed - self.n_blocks
        if missing <= 0:
            return None
        extra = blocks_to_hold(n_slots, bs) - needed
        try:
            return self._allocate(missing + extra, wait)
        except BlockPoolExhaustedError:
            if extra:
                with contextlib.suppress(BlockPoolExhaustedError):
                    return self._allocate(missing)
            if not self._reclaim(missing):
                raise
        return self._allocate(missing)

    def _reclaim(self, n_blocks: int) -> bool:
        """Ask the storage's ``reclaim`` (the worker's prompt cache) for the bytes of
        ``n_blocks`` refused blocks; whether it freed any (then the allocation is retried)."""
        reclaim = self.storage.reclaim
        if reclaim is None:
            return False
        return reclaim(n_blocks * (self.layout.k_block_bytes + self.layout.v_block_bytes)) > 0

    def reserve_exactly(self, n_blocks: int) -> None:
        """Hold ``n_blocks`` blocks per stream more, no growth reserve, in one pool call that
        never waits and never reclaims (a prompt-cache entry's memory). On error nothing has
        changed.

        Raises:
            BlockPoolExhaustedError: The pool cannot give them now.
        """
        self.adopt((self.n_blocks + n_blocks) * self.layout.block_size, self._allocate(n_blocks))

    def adopt(self, n_slots: int, taken: tuple[list[Block], list[Block]] | None) -> None:
        """Back ``n_slots`` slots with the blocks :meth:`take` returned (on this sequence's
        thread: it extends the storage). On error the blocks are freed."""
        if taken is None:
            return
        k_new, v_new = taken
        try:
            self.storage.extend(
                self.buffers,
                [b.block_id for b in k_new],
                [b.block_id for b in v_new] if v_new is not k_new else (),
            )
        except BaseException:
            self.pool.free(k_new if v_new is k_new else [*k_new, *v_new])
            raise
        self._pool_n_used.extend(b.n_used for b in k_new)
        self._k_blocks.extend(k_new)
        if self._v_blocks is not self._k_blocks:
            self._v_blocks.extend(v_new)
        self.capacity = self.n_blocks * self.layout.block_size
        self.sync_usage(max(self.n_tokens, n_slots))

    def _allocate(self, n_blocks: int, wait: float = 0.0) -> tuple[list[Block], list[Block]]:
        return allocate_kv_blocks(self.pool, self.owner, self.layout, n_blocks, wait)

    def quantize(self, quantization: KVQuantization) -> QuantizedKVLayout:
        """Quantize every layer's keys and values (``mx.quantize``, as mlx-lm's
        ``KVCache.to_quantized``) into quantized blocks: the full-precision blocks go back first,
        then as many blocks of the quantized format are taken. Once quantized, a call with the
        same bits and group size does nothing.

        Raises:
            ValueError: The sequence is quantized already, otherwise; or a head dimension the
                group size does not divide.
            BlockPoolExhaustedError: The pool gave no quantized blocks; the sequence then holds
                none (release it).
        """
        if isinstance(self.layout, QuantizedKVLayout):
            done = (self.layout.bits, self.layout.group_size)
            if done != (quantization.bits, quantization.group_size):
                raise ValueError(
                    f"PooledSequence {self.owner!r} is quantized as {self.layout.format} already"
                )
            return self.layout
        fp = self.layout
        if not isinstance(fp, KVLayout):
            raise ValueError("PooledSequence: only a single model's sequence can be quantized")
        target = quantization.layout(fp)
        storage = self.quantized_storage
        if storage is None:
            storage = self.quantized_storage = QuantizedBlockStorage(
                target, separate_kv=self.storage.separate_kv
            )
        elif storage.layout.format != target.format:
            raise ValueError(
                f"PooledSequence: its quantized storage holds {storage.layout.format}, not "
                f"{target.format}"
            )
        buffers = self.buffers
        keys = [target.quantize(k) for k in buffers.keys]
        values = [target.quantize(v) for v in buffers.values]
        mx.eval(keys, values)
        n_blocks = self.n_blocks
        held = self.blocks()
        self._k_blocks.clear()
        self._v_blocks.clear()
        self._pool_n_used.clear()
        self._synced_tokens = 0
        self.capacity = 0
        self.storage.close(buffers)
        self.storage = storage
        self.layout = target
        self.buffers = storage.open(self.owner)
        if held:
            self.pool.free(held)
        if n_blocks:
            self.adopt(self.n_tokens, self._allocate(n_blocks))
            for i in range(target.n_layers):
                self.buffers.keys[i] = keys[i]
                self.buffers.values[i] = values[i]
        return target

    # -- shrink and usage ------------------------------------------------------------------------

    def settle(self) -> None:
        """After offsets went down: give back blocks beyond what the tokens left need (plus the
        reserve), and sync ``n_used``. Nothing happens until the longest layer got shorter."""
        if self.released:
            return
        n_tokens = self.n_tokens
        keep = blocks_to_hold(n_tokens, self.layout.block_size)
        if keep < self.n_blocks:
            dropped = self._k_blocks[keep:]
            if self._v_blocks is not self._k_blocks:
                dropped.extend(self._v_blocks[keep:])
            self.pool.free(dropped)
            self.storage.truncate(self.buffers, keep)
            del self._k_blocks[keep:]
            if self._v_blocks is not self._k_blocks:
                del self._v_blocks[keep:]
            del self._pool_n_used[keep:]
            self.capacity = keep * self.layout.block_size
        self.sync_usage(n_tokens)

    def sync_usage(self, n_tokens: int | None = None) -> None:
        """Tell the pool how many slots of each block are filled, in at most one call.

        Only blocks whose count changed since the last sync are sent: those between the old
        and the new token count, and blocks allocated since (which the pool counts as full).
        """
        if n_tokens is None:
            n_tokens = self.n_tokens
        bs = self.layout.block_size
        first = min(self._synced_tokens, n_tokens) // bs
        updates: list[tuple[Block, int]] = []
        changed: list[tuple[int, int]] = []
        for i in range(first, self.n_blocks):
            want = min(bs, max(0, n_tokens - i * bs))
            if self._pool_n_used[i] != want:
                changed.append((i, want))
                updates.append((self._k_blocks[i], want))
                if self._v_blocks is not self._k_blocks:
                    updates.append((self._v_blocks[i], want))
        if updates:
            self.pool.mark_used_many(updates)
            for i, want in changed:
                self._pool_n_used[i] = want
        self._synced_tokens = n_tokens

    # -- release ---------------------------------------------------------------------------------

    def release(self) -> None:
        """Give every block back (``pool.free_all(owner)``) and drop the memory. Idempotent.

        The storage drops the memory even when the pool call fails (the error propagates): the
        blocks are unusable either way, and the daemon reclaims what a dead session held.
        """
        if self.released:
            return
        self.released = True
        try:
            self.pool.free_all(self.owner)
        finally:
            self.storage.close(self.buffers)
            self._k_blocks.clear()
            self._v_blocks.clear()
            self._pool_n_used.clear()
            self.offsets = [0] * self.layout.n_layers
            self.capacity = 0
            self._synced_tokens = 0

    def __repr__(self) -> str:
        state = "released" if self.released else f"{self.n_tokens} tokens"
        return f"PooledSequence(owner={self.owner!r}, {state}, {self.n_blocks} block(s)/stream)"


class PooledLayer:
    """What one layer's view of a :class:`PooledSequence` is, quantized or not: its offset,
    the shapes it is given to write, trimming, masks, bytes and release (mlx-lm's cache
    protocol but for the keys and values themselves)."""

    def __init__(self, sequence: PooledSequence, layer: int) -> None:
        self.sequence = sequence
        self.layer = layer
        layout = sequence.layout.layer_layout(layer)
        self._head_shape = (layout.n_kv_heads, layout.k_head_dim, layout.v_head_dim)
        self._dtype = layout.dtype

    @property
    def offset(self) -> int:
        """Tokens cached in this layer (the RoPE position of the next token)."""
        return self.sequence.offsets[self.layer]

    def _backed_slots(self, keys: mx.array, values: mx.array) -> tuple[int, int]:
        """The slots ``[prev, end)`` a write of ``keys``/``values`` takes, once checked and
        backed by the sequence's blocks (see ``update_and_fetch``)."""
        self._check(keys, values)
        prev = self.sequence.offsets[self.layer]
        end = prev + keys.shape[2]
        if end > self.sequence.capacity:
            self.sequence.reserve(end)
        return prev, end

    def _check(self, keys: mx.array, values: mx.array) -> None:
        n_kv_heads, k_dim, v_dim = self._head_shape
        k_shape = keys.shape
        v_shape = values.shape
        dtype = self._dtype
        if (
            len(k_shape) != 4
            or k_shape[0] != 1
            or k_shape[1] != n_kv_heads
            or k_shape[3] != k_dim
            or v_shape != (1, n_kv_heads, k_shape[2], v_dim)
            or keys.dtype != dtype
            or values.dtype != dtype
        ):
            raise ValueError(
                f"{type(self).__name__}: expected keys (1, {n_kv_heads}, S, {k_dim}) and values "
                f"(1, {n_kv_heads}, S, {v_dim}) of {dtype}; got {k_shape} {keys.dtype} and "
                f"{v_shape} {values.dtype}. A pooled cache holds one sequence of one layout."
            )

    @property
    def meta_state(self) -> str:
        """No metadata beyond ``state`` (as mlx-lm's base cache)."""
        return ""

    @meta_state.setter
    def meta_state(self, value: str) -> None:
        if value:
            raise ValueError("PooledKVCache has no meta state but one was set")

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens (at most ``offset``); return how many were dropped.

        Once every layer is trimmed, blocks the sequence no longer needs go back to the pool.
        """
        seq = self.sequence
        n = max(0, min(seq.offsets[self.layer], n))
        seq.offsets[self.layer] -= n
        seq.settle()
        return n

    def size(self) -> int:
        return self.offset

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array | str | None:
        """The attention mask for ``N`` new tokens after ``offset`` cached ones (as stock)."""
        return create_attention_mask(
            N, offset=self.offset, return_array=return_array, window_size=window_size
        )

    def empty(self) -> bool:
        """Whether this layer holds no tokens."""
        return self.offset == 0

    @property
    def nbytes(self) -> int:
        """Bytes of this layer's buffers (its share of the sequence's blocks)."""
        buffers = self.sequence.buffers
        if not buffers.keys:
            return 0
        return buffer_nbytes(buffers.keys[self.layer]) + buffer_nbytes(buffers.values[self.layer])

    def release(self) -> None:
        """Release the whole sequence (every layer): see :meth:`PooledSequence.release`."""
        self.sequence.release()


class PooledKVCache(PooledLayer):
    """One layer's view of a :class:`PooledSequence`, with mlx-lm's KV cache protocol.

    Keys and values are written in place into the sequence's contiguous per-layer buffers and
    attention reads their prefix, exactly as with stock ``KVCache``.
    """

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``keys``/``values`` of shape (1, n_kv_heads, S, head_dim); return all cached.

        Raises:
            ValueError: Shapes or dtype differ from the storage's layout (nothing changed).
            BlockPoolExhaustedError: The pool has no blocks for the new slots (nothing changed).
        """
        seq = self.sequence
        layer = self.layer
        prev, end = self._backed_slots(keys, values)
        buffers = seq.buffers
        k_buf = buffers.keys[layer]
        v_buf = buffers.values[layer]
        k_buf[..., prev:end, :] = keys
        v_buf[..., prev:end, :] = values
        seq.offsets[layer] = end
        return k_buf[..., :end, :], v_buf[..., :end, :]

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        """(keys, values) cached in this layer: views of the buffers up to ``offset``."""
        seq = self.sequence
        end = seq.offsets[self.layer]
        if not seq.buffers.keys:
            n_kv_heads, k_dim, v_dim = self._head_shape
            dtype = self._dtype
            return (
                mx.zeros((1, n_kv_heads, 0, k_dim), dtype),
                mx.zeros((1, n_kv_heads, 0, v_dim), dtype),
            )
        return (
            seq.buffers.keys[self.layer][..., :end, :],
            seq.buffers.values[self.layer][..., :end, :],
        )

    @state.setter
    def state(self, value: tuple[Any, ...]) -> None:
        """Replace this layer's content: (keys, values), or stock ``KVCache.state``
        (keys, values, offset) whose arrays may be longer than ``offset``."""
        if len(value) == 3:
            keys, values, offset = value
            keys = keys[..., :offset, :]
            values = values[..., :offset, :]
        else:
            keys, values = value
        self._check(keys, values)
        seq = self.sequence
        n = keys.shape[2]
        seq.reserve(n)
        if n:
            seq.buffers.keys[self.layer][..., :n, :] = keys
            seq.buffers.values[self.layer][..., :n, :] = values
        seq.offsets[self.layer] = n
        seq.settle()

    def __deepcopy__(self, memo: dict[int, Any]) -> KVCache:
        """A detached snapshot: a stock ``KVCache`` with a copy of this layer, no pool blocks."""
        snapshot = KVCache()
        end = self.offset
        if end:
            keys, values = self.state
            snapshot.keys = mx.contiguous(keys)
            snapshot.values = mx.contiguous(values)
            # Evaluate now, so the copy stops referencing this sequence's buffers (a live
            # reference would make the next in-place write copy the whole buffer).
            mx.eval(snapshot.keys, snapshot.values)
            snapshot.offset = end
        return snapshot

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> PooledQuantizedKVCache:
        """This layer as a :class:`PooledQuantizedKVCache`, the whole sequence quantized on the
        first layer's call (mlx-lm's ``maybe_quantize_kv_cache`` calls it for every layer and
        puts the result in the cache list, as for ``KVCache.to_quantized``).

        Raises:
            ValueError: bits or group size mlx-lm's quantized cache refuses, or a head
                dimension the group size does not divide.
            BlockPoolExhaustedError: No quantized blocks (the sequence holds none then).
        """
        self.sequence.quantize(KVQuantization(bits, group_size))
        return PooledQuantizedKVCache(self.sequence, self.layer)

    def __repr__(self) -> str:
        return f"PooledKVCache(layer={self.layer}, offset={self.offset}, {self.sequence!r})"


class PooledQuantizedKVCache(PooledLayer):
    """One layer's view of a quantized :class:`PooledSequence`, with mlx-lm's
    ``QuantizedKVCache`` protocol: keys and values are quantized as they are written, in place,
    into the sequence's contiguous ``(packed, scales, biases)`` buffers, and attention reads
    their prefix (``bits`` and ``group_size`` send it down mlx-lm's quantized path).
    """

    def __init__(self, sequence: PooledSequence, layer: int) -> None:
        layout = sequence.layout
        if not isinstance(layout, QuantizedKVLayout):
            raise ValueError("PooledQuantizedKVCache: the sequence is not quantized")
        super().__init__(sequence, layer)
        self.layout = layout
        self.bits = layout.bits
        self.group_size = layout.group_size

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        """Quantize and append ``keys``/``values`` (1, n_kv_heads, S, head_dim); return every
        cached slot's (packed, scales, biases), as ``QuantizedKVCache`` does.

        Raises:
            ValueError: Shapes or dtype differ from the model's layout (nothing changed).
            BlockPoolExhaustedError: The pool has no blocks for the new slots (nothing changed).
        """
        seq = self.sequence
        layer = self.layer
        prev, end = self._backed_slots(keys, values)
        slots = (Ellipsis, slice(prev, end), slice(None))
        k_buf = seq.buffers.keys[layer]
        v_buf = seq.buffers.values[layer]
        buffer_write(k_buf, slots, self.layout.quantize(keys))
        buffer_write(v_buf, slots, self.layout.quantize(values))
        seq.offsets[layer] = end
        return prefix(k_buf, end), prefix(v_buf, end)

    @property
    def state(self) -> tuple[Any, Any]:
        """(keys, values) cached in this layer: views of the buffers' triples up to ``offset``."""
        seq = self.sequence
        if not seq.buffers.keys:
            empty = self.layout.zeros(1, 0, self.layout.k_head_dim)
            return empty, self.layout.zeros(1, 0, self.layout.v_head_dim)
        end = seq.offsets[self.layer]
        return prefix(seq.buffers.keys[self.layer], end), prefix(
            seq.buffers.values[self.layer], end
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> QuantizedKVCache:
        """A detached snapshot: a stock ``QuantizedKVCache`` with a copy of this layer."""
        snapshot: Any = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        end = self.offset
        if end:
            keys, values = self.state
            snapshot.keys = buffer_map(mx.contiguous, keys)
            snapshot.values = buffer_map(mx.contiguous, values)
            mx.eval(snapshot.keys, snapshot.values)  # as PooledKVCache's: no live reference
            snapshot.offset = end
        return snapshot

    def __repr__(self) -> str:
        return (
            f"PooledQuantizedKVCache(layer={self.layer}, {self.layout.format}, "
            f"offset={self.offset}, {self.sequence!r})"
        )


class PooledPromptCache(list[PooledKVCache | PooledQuantizedKVCache]):
    """The per-layer caches of one sequence, as mlx-lm's ``prompt_cache`` list, plus release.

    Use as a context manager so the blocks go back however generation ends::

        with make_pooled_cache(model, pool, owner="req-1") as cache:
            for token, logprobs in generate_step(prompt, model, prompt_cache=cache):
                ...
    """

    def __init__(self, caches: Iterable[PooledKVCache], sequence: PooledSequence) -> None:
        super().__init__(caches)
        self.sequence = sequence

    @property
    def owner(self) -> Owner:
        return self.sequence.owner

    @property
    def nbytes(self) -> int:
        """Bytes of all layers' buffers."""
        return sum(cache.nbytes for cache in self)

    def release(self) -> None:
        """Give every block back to the pool and drop the memory (see PooledSequence)."""
        self.sequence.release()

    def __enter__(self) -> PooledPromptCache:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __deepcopy__(self, memo: dict[int, Any]) -> list[Any]:
        """A plain list of detached ``KVCache`` snapshots (see the module docstring)."""
        return [copy.deepcopy(cache, memo) for cache in self]


def make_pooled_cache(
    model: nn.Module,
    pool: BlockPool,
    owner: Owner,
    *,
    storage: MLXBlockStorage | None = None,
    quantized_storage: QuantizedBlockStorage | None = None,
) -> PooledPromptCache:
    """One pooled cache per layer of ``model``, drawing blocks from ``pool`` as ``owner``.

    Args:
        model: An mlx-lm model whose layers all use full attention (a stock ``KVCache`` each).
        pool: A ``BlockPoolAllocator`` or ``PoolClient``.
        owner: The owner id for this sequence's blocks; must not be active in the pool.
        storage: Where the memory lives. Pass one storage per model to share it (and its byte
            count) between the sequences of a worker; by default the cache gets its own.
        quantized_storage: Where the memory lives once mlx-lm quantizes the cache
            (``kv_bits``), shared as ``storage``; by default the sequence makes its own then.

    Raises:
        ValueError: The model has layers of another cache kind (sliding window, SSM, ...), or
            ``storage`` does not fit the model or the pool.
        OwnerAlreadyActiveError: ``owner`` is active in the pool.
    """
    reason = unpoolable_reason(make_prompt_cache(model))
    if reason is not None:
        raise ValueError(f"make_pooled_cache: {reason}")
    if storage is None:
        layout = KVLayout.from_model(model, block_size=pool.config.block_size)
        storage = MLXBlockStorage(layout, separate_kv=pool.config.separate_kv)
    n_layers = len(model.layers)
    if storage.layout.n_layers != n_layers:
        raise ValueError(
            f"make_pooled_cache: storage layout has {storage.layout.n_layers} layers, the model "
            f"{n_layers}"
        )
    sequence = PooledSequence(pool, owner, storage)
    sequence.quantized_storage = quantized_storage
    return PooledPromptCache((PooledKVCache(sequence, i) for i in range(n_layers)), sequence)
