"""The worker-local memory behind pool block ids: which MLX buffer holds which block.

The pool (local allocator or daemon) only hands out block ids. :class:`MLXBlockStorage` is where
an id becomes memory the worker holds: block ``j`` of a sequence is token slots
``[j * block_size, (j + 1) * block_size)`` of that sequence's per-layer K (or V) buffer, for every
layer of the model. A K block id owns that slot range of every layer's keys buffer, a V block id
the same range of every layer's values buffer, and in a pool without separate streams one "kv"
id owns both.

Layout choice (measured; see docs/cache.md): each sequence's keys and values are one contiguous
``(1, n_kv_heads, n_blocks * block_size, head_dim)`` array per layer, because attention reads the
cache every decode step and only a contiguous prefix reads as fast as mlx-lm's stock ``KVCache``.
Gathering scattered per-block arrays every step halves decode speed; concatenating per-block
arrays costs ~30%. The block-id map is therefore id -> (sequence, block index), and a block's
memory is a segment of the sequence's buffer (``read_block`` returns it).

Memory follows the blocks held, exactly: the buffers of a sequence are always ``len(block ids) *
block_size`` slots long, so ``nbytes == sum of bytes_per_block(stream) over held ids``. Growing a
sequence copies its buffers into longer ones (as stock ``KVCache`` does every 256 tokens), and
dropping blocks copies the kept prefix so the old buffer is really released. The storage keeps no
reuse cache of its own: dropped buffers go back to MLX's allocator, whose buffer cache (bounded by
``mx.set_cache_limit``, emptied by ``mx.clear_cache``) is the only reuse cache. Blocks the pool
retires are free blocks, which no storage holds, so retiring needs nothing here.

Thread-safe for several sequences: the map and the sequence table are guarded by one lock, taken
only when blocks come or go (never per decoded token). One sequence must be driven by one thread
at a time, as one mlx-lm generation is.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
from vqpool.shared.allocator import DEFAULT_BLOCK_SIZE, Owner
from vqpool.worker.kv.kv_probe import probe_kv_layout

# The pool's block format tag for each dtype a cache can hold (Block.format).
_FORMAT_OF_DTYPE: dict[mx.Dtype, str] = {
    mx.float32: "fp32",
    mx.float16: "fp16",
    mx.bfloat16: "bf16",
}


@dataclass(frozen=True)
class KVLayout:
    """What one token slot of one model's KV cache looks like, for every layer.

    Attributes:
        n_layers: Attention layers (one cache per layer).
        n_kv_heads: Key/value heads per layer.
        k_head_dim: Size of one key head.
        v_head_dim: Size of one value head.
        dtype: Element type of keys and values.
        block_size: Token slots per block (the pool's ``config.block_size``).
    """

    n_layers: int
    n_kv_heads: int
    k_head_dim: int
    v_head_dim: int
    dtype: mx.Dtype
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_kv_heads", "k_head_dim", "v_head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVLayout: {name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in _FORMAT_OF_DTYPE:
            raise ValueError(
                f"KVLayout: dtype must be one of {sorted(map(str, _FORMAT_OF_DTYPE))}, "
                f"got {self.dtype}"
            )

    @classmethod
    def from_model(cls, model: nn.Module, block_size: int = DEFAULT_BLOCK_SIZE) -> KVLayout:
        """Read the layout off the keys and values an mlx-lm model's layers write to their
        caches in a one-token forward pass (see :mod:`vqpool.worker.kv.kv_probe`), whatever its
        attention modules look like: separate or fused projections, q/k norms, biases.

        Raises:
            ValueError: One line: a layer whose cache is not mlx-lm's plain ``KVCache``
                (sliding window, state-space, quantized, ...), layers that write different
                layouts, or a model the probe cannot run.
        """
        probed = probe_kv_layout(model)
        return cls(
            n_layers=probed.n_layers,
            n_kv_heads=probed.n_kv_heads,
            k_head_dim=probed.k_head_dim,
            v_head_dim=probed.v_head_dim,
            dtype=probed.dtype,
            block_size=block_size,
        )

    @property
    def format(self) -> str:
        """The pool's format tag for blocks of this layout ("fp32", "fp16", "bf16")."""
        return _FORMAT_OF_DTYPE[self.dtype]

    @property
    def k_block_bytes(self) -> int:
        """Bytes of one K block: its slots of every layer's keys."""
        return self.n_layers * self.n_kv_heads * self.block_size * self.k_head_dim * self.dtype.size

    @property
    def v_block_bytes(self) -> int:
        """Bytes of one V block: its slots of every layer's values."""
        return self.n_layers * self.n_kv_heads * self.block_size * self.v_head_dim * self.dtype.size

    def layer_layout(self, layer: int) -> KVLayout:
        """The layout of layer ``layer``'s slots: this one for every layer (a model and its
        draft model in one block have two: ``PairedLayout``)."""
        return self

    def bytes_per_block(self, stream: str) -> int:
        """Bytes one block of ``stream`` ("k", "v", or "kv" for both) stands for."""
        if stream == "k":
            return self.k_block_bytes
        if stream == "v":
            return self.v_block_bytes
        if stream == "kv":
            return self.k_block_bytes + self.v_block_bytes
        raise ValueError(f"KVLayout: stream must be 'k', 'v' or 'kv', got {stream!r}")


class SlotLayout(Protocol):
    """What a pooled sequence needs of a layout: a :class:`KVLayout`, or a model's and its
    draft model's layouts in one block (``PairedLayout``)."""

    @property
    def block_size(self) -> int: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def k_block_bytes(self) -> int: ...
    @property
    def v_block_bytes(self) -> int: ...
    @property
    def format(self) -> str: ...
    def layer_layout(self, layer: int) -> KVLayout: ...


class SequenceBuffers:
    """One sequence's KV memory in an :class:`MLXBlockStorage`: per-layer contiguous buffers
    whose slots are exactly the slots of the block ids listed, in order.

    Caches write ``keys[layer][..., a:b, :]`` in place and hand attention the prefix
    ``keys[layer][..., :n, :]``. MLX writes a slice in place only while nothing else references
    the buffer at evaluation time, so nobody should keep views of these arrays across writes.
    """

    __slots__ = ("k_block_ids", "key", "keys", "v_block_ids", "values")

    def __init__(self, key: Owner) -> None:
        self.key = key
        self.k_block_ids: list[int] = []
        # The same list object as k_block_ids when one "kv" id holds both.
        self.v_block_ids: list[int] = []
        # Per layer: an array, or a quantized storage's (packed, scales, biases) triple.
        self.keys: list[Any] = []
        self.values: list[Any] = []

    @property
    def n_blocks(self) -> int:
        """Blocks (per stream) the sequence's buffers cover."""
        return len(self.k_block_ids)


class MLXBlockStorage:
    """Maps the block ids a worker holds to MLX memory, for one model's :class:`KVLayout`.

    Sequences are opened by key (the pool owner id), grown by the block ids the pool handed out
    (:meth:`extend`), shrunk by dropping trailing blocks (:meth:`truncate`) and closed
    (:meth:`close`), which releases all their memory. Every id maps to at most one sequence.

    Args:
        layout: The model's KV layout; the storage refuses blocks of any other size.
        separate_kv: True when K and V blocks come from separate pool streams ("k", "v"),
            False when one "kv" block id holds both (the pool's ``config.separate_kv``).
    """

    def __init__(self, layout: KVLayout, *, separate_kv: bool = True) -> None:
        self.layout = layout
        self.separate_kv = separate_kv
        self._lock = threading.Lock()
        self._sequences: dict[Owner, SequenceBuffers] = {}
        # block id -> (its sequence, its index there): the map the storage exists for.
        self._where: dict[int, tuple[SequenceBuffers, int]] = {}
        self.reclaim: Callable[[int], int] | None = None
        """Called with the bytes a sequence's allocation lacks when the pool refused it; returns
        the bytes it gave back to the pool (the worker's prompt cache frees entries, LRU first),
        and the allocation is retried if any. None: refusals are final."""

    # -- sequences -------------------------------------------------------------------------------

    def open(self, key: Owner) -> SequenceBuffers:
        """Start an empty sequence (no blocks, no memory) under ``key``.

        Raises:
            ValueError: A sequence with that key is open.
        """
        with self._lock:
            if key in self._sequences:
                raise ValueError(f"MLXBlockStorage: a sequence with key {key!r} is already open")
            seq = self._sequences[key] = SequenceBuffers(key)
            if not self.separate_kv:
                seq.v_block_ids = seq.k_block_ids
            return seq

    def extend(
        self, seq: SequenceBuffers, k_block_ids: Sequence[int], v_block_ids: Sequence[int] = ()
    ) -> None:
        """Append blocks to the end of ``seq``, growing each layer's buffers by their slots.

        Without separate streams pass the "kv" ids as ``k_block_ids`` only. New slots are zero
        until written.

        Raises:
            ValueError: ``seq`` is not open here, an id is already mapped (here or twice in the
                call), the K and V counts differ, or V ids are given without separate streams.
                Nothing is changed.
        """
        with self._lock:
            self._extend_locked(seq, list(k_block_ids), list(v_block_ids))

    def _extend_locked(self, seq: SequenceBuffers, k_ids: list[int], v_ids: list[int]) -> None:
        self._check_open(seq)
        if not self.separate_kv:
            if v_ids not in ([], k_ids):
                raise ValueError(
                    "MLXBlockStorage: without separate streams one 'kv' id holds K and V; pass "
                    "no V ids (or the K ids again)"
                )
            v_ids = []
        elif len(v_ids) != len(k_ids):
            raise ValueError(
                f"MLXBlockStorage: {len(k_ids)} K block(s) but {len(v_ids)} V block(s); a "
                "sequence grows by the same number of each"
            )
        new_ids = k_ids + v_ids
        if len(set(new_ids)) != len(new_ids):
            raise ValueError(f"MLXBlockStorage: a block id appears twice in {new_ids}")
        mapped = [bid for bid in new_ids if bid in self._where]
        if mapped:
            raise ValueError(f"MLXBlockStorage: block id(s) {mapped} are already mapped")
        if not k_ids:
            return
        first = seq.n_blocks
        seq.k_block_ids.extend(k_ids)
        if self.separate_kv:
            seq.v_block_ids.extend(v_ids)
        for i, bid in enumerate(k_ids):
            self._where[bid] = (seq, first + i)
        for i, bid in enumerate(v_ids):
            self._where[bid] = (seq, first + i)
        self._resize(seq, seq.n_blocks)

    def truncate(self, seq: SequenceBuffers, n_blocks: int) -> tuple[list[int], list[int]]:
        """Keep the first ``n_blocks`` blocks of ``seq`` and release the memory of the rest.

        Returns the dropped (K ids, V ids); V ids are empty without separate streams.

        Raises:
            ValueError: ``seq`` is not open here, or ``n_blocks`` is outside 0..its blocks.
        """
        with self._lock:
            return self._truncate_locked(seq, n_blocks)

    def _truncate_locked(self, seq: SequenceBuffers, n_blocks: int) -> tuple[list[int], list[int]]:
        self._check_open(seq)
        if not 0 <= n_blocks <= seq.n_blocks:
            raise ValueError(
                f"MLXBlockStorage: cannot keep {n_blocks} of the {seq.n_blocks} block(s) of "
                f"sequence {seq.key!r}"
            )
        dropped_k = seq.k_block_ids[n_blocks:]
        dropped_v = seq.v_block_ids[n_blocks:] if self.separate_kv else []
        for bid in dropped_k + dropped_v:
            del self._where[bid]
        del seq.k_block_ids[n_blocks:]
        if self.separate_kv:
            del seq.v_block_ids[n_blocks:]
        self._resize(seq, n_blocks)
        return dropped_k, dropped_v

    def close(self, seq: SequenceBuffers) -> None:
        """Release all memory of ``seq`` and forget its ids and key. Closing twice is a no-op."""
        with self._lock:
            if self._sequences.get(seq.key) is not seq:
                return
            self._truncate_locked(seq, 0)
            del self._sequences[seq.key]

    def _check_open(self, seq: SequenceBuffers) -> None:
        if self._sequences.get(seq.key) is not seq:
            raise ValueError(f"MLXBlockStorage: sequence {seq.key!r} is not open in this storage")

    def _resize(self, seq: SequenceBuffers, n_blocks: int) -> None:
        """Make every layer's buffers exactly ``n_blocks`` blocks long, keeping the content."""
        layout = self.layout
        n_slots = n_blocks * layout.block_size
        if n_slots == 0:
            seq.keys = []
            seq.values = []
            return
        if not seq.keys:
            k_shape = (1, layout.n_kv_heads, n_slots, layout.k_head_dim)
            v_shape = (1, layout.n_kv_heads, n_slots, layout.v_head_dim)
            seq.keys = [mx.zeros(k_shape, layout.dtype) for _ in range(layout.n_layers)]
            seq.values = [mx.zeros(v_shape, layout.dtype) for _ in range(layout.n_layers)]
            return
        have = seq.keys[0].shape[2]
        if n_slots > have:
            seq.keys = [_grown(buf, n_slots - have) for buf in seq.keys]
            seq.values = [_grown(buf, n_slots - have) for buf in seq.values]
        elif n_slots < have:
            # A slice would keep the whole old buffer alive; a contiguous copy frees it.
            seq.keys = [mx.contiguous(buf[..., :n_slots, :]) for buf in seq.keys]
            seq.values = [mx.contiguous(buf[..., :n_slots, :]) for buf in seq.values]

    # -- reads -----------------------------------------------------------------------------------

    def sequence(self, key: Owner) -> SequenceBuffers | None:
        """The open sequence with this key, or None."""
        with self._lock:
            return self._sequences.get(key)

    def holds(self, block_id: int) -> bool:
        """Whether ``block_id`` maps to memory here."""
        return block_id in self._where

    def read_block(self, block_id: int) -> dict[str, list[mx.array]]:
        """The memory of one block: its slots of every layer, as {"k": [...], "v": [...]}.

        A K id gives "k" only, a V id "v" only, a "kv" id both. The arrays are views of the
        sequence's buffers: read them, do not keep them across the next write (see
        :class:`SequenceBuffers`).

        Raises:
            KeyError: ``block_id`` is not held here.
        """
        with self._lock:
            found = self._where.get(block_id)
        if found is None:
            raise KeyError(f"MLXBlockStorage: block {block_id} is not held by this storage")
        seq, index = found
        bs = self.layout.block_size
        window = slice(index * bs, (index + 1) * bs)
        out: dict[str, list[mx.array]] = {}
        if not self.separate_kv or seq.k_block_ids[index] == block_id:
            out["k"] = [buf[..., window, :] for buf in seq.keys]
        if not self.separate_kv or seq.v_block_ids[index] == block_id:
            out["v"] = [buf[..., window, :] for buf in seq.values]
        return out

    @property
    def n_blocks(self) -> int:
        """Block ids mapped to memory here (K and V ids counted apart)."""
        return len(self._where)

    @property
    def n_sequences(self) -> int:
        """Open sequences."""
        return len(self._sequences)

    def bytes_per_block(self, stream: str) -> int:
        """Bytes one block of ``stream`` holds here (see :meth:`KVLayout.bytes_per_block`)."""
        return self.layout.bytes_per_block(stream)

    def expected_nbytes(self) -> int:
        """Blocks held x bytes per block: what :attr:`nbytes` must equal."""
        # Per block index of a sequence: one K and one V block, or one "kv" block (same bytes).
        per_index = self.layout.k_block_bytes + self.layout.v_block_bytes
        with self._lock:
            return sum(seq.n_blocks for seq in self._sequences.values()) * per_index

    @property
    def nbytes(self) -> int:
        """Bytes of the MLX buffers this storage holds now."""
        with self._lock:
            return sum(
                sum(buf.nbytes for buf in seq.keys) + sum(buf.nbytes for buf in seq.values)
                for seq in self._sequences.values()
            )

    def __repr__(self) -> str:
        return (
            f"MLXBlockStorage({self.n_sequences} sequence(s), {self.n_blocks} block(s), "
            f"{self.nbytes} bytes)"
        )


class BlockStorage(Protocol):
    """What a pooled sequence needs of a storage: an :class:`MLXBlockStorage`, or the paired
    storage of a model and its draft model (``PairedBlockStorage``)."""

    reclaim: Callable[[int], int] | None

    @property
    def layout(self) -> SlotLayout: ...
    @property
    def separate_kv(self) -> bool: ...
    def open(self, key: Owner) -> SequenceBuffers: ...
    def extend(
        self, seq: SequenceBuffers, k_block_ids: Sequence[int], v_block_ids: Sequence[int] = ()
    ) -> None: ...
    def truncate(self, seq: SequenceBuffers, n_blocks: int) -> tuple[list[int], list[int]]: ...
    def close(self, seq: SequenceBuffers) -> None: ...


def _grown(buf: mx.array, n_new_slots: int) -> mx.array:
    """``buf`` with ``n_new_slots`` zero slots appended along the token axis (a copy)."""
    b, h, _, d = buf.shape
    return mx.concatenate([buf, mx.zeros((b, h, n_new_slots, d), buf.dtype)], axis=2)
