"""Quantized KV blocks: their layout, their bytes, and the storage that maps their ids to memory.

mlx-lm's ``QuantizedKVCache`` keeps each layer's keys (and values) as the three arrays
``mx.quantize`` makes of them, packed along the head dimension: ``(…, head_dim * bits / 32)``
uint32 words, then ``(…, head_dim / group_size)`` scales and as many biases of the model's
dtype. A quantized block here is that triple's slots ``[j * block_size, (j + 1) * block_size)``
for every layer, in the same contiguous per-sequence buffers the full-precision storage uses
(:mod:`vqpool.worker.kv.storage`): attention reads a prefix of each of the three arrays, as
``quantized_scaled_dot_product_attention`` reads ``QuantizedKVCache``'s.

A *buffer* below is one layer's keys (or values): an ``mx.array`` in full precision, or the
``(packed, scales, biases)`` tuple when quantized. The helpers act on either, part by part along
the token axis (2) and the row axis (0), so the pooled caches move both kinds the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from vqpool.shared.kv_formats import quantized_format, token_bytes
from vqpool.worker.kv.storage import KVLayout, MLXBlockStorage, SequenceBuffers

KVBuffer = mx.array | tuple[mx.array, ...]
"""One layer's keys or values: a full-precision array, or mx.quantize's (packed, scales,
biases)."""

KV_BITS = (4, 8)
"""Bits per quantized value the worker serves (``--kv-bits``), as mlx_lm.server's."""


@dataclass(frozen=True)
class KVQuantization:
    """``--kv-bits``, ``--kv-group-size`` and ``--quantized-kv-start``, with mlx-lm's meaning
    (``maybe_quantize_kv_cache``): once a sequence holds ``start`` tokens or more after a
    forward pass, its whole cache is quantized to ``bits`` in groups of ``group_size``.

    Raises:
        ValueError: bits not 4 or 8, a group size ``mx.quantize`` refuses, a negative start.
    """

    bits: int
    group_size: int = 64
    start: int = 0

    def __post_init__(self) -> None:
        if self.bits not in KV_BITS:
            raise ValueError(f"--kv-bits must be 4 or 8, got {self.bits}")
        quantized_format(self.bits, self.group_size)  # the group size's ValueError
        if self.start < 0:
            raise ValueError(f"--quantized-kv-start must be >= 0, got {self.start}")

    @property
    def format(self) -> str:
        """The pool's format tag of blocks quantized so ("q4g64", ...)."""
        return quantized_format(self.bits, self.group_size)

    def due(self, offset: int) -> bool:
        """Whether a cache holding ``offset`` tokens after a forward pass is quantized now (as
        ``maybe_quantize_kv_cache`` after each model call: never before the first)."""
        return offset > 0 and offset >= self.start

    def layout(self, fp: KVLayout) -> QuantizedKVLayout:
        """The quantized layout of ``fp``'s model.

        Raises:
            ValueError: A head dimension the group size does not divide (one line: the model
                cannot be served with this ``--kv-group-size``).
        """
        for name, dim in (("key", fp.k_head_dim), ("value", fp.v_head_dim)):
            if dim % self.group_size:
                raise ValueError(
                    f"--kv-group-size {self.group_size} does not divide the model's {name} head "
                    f"dimension {dim}; choose a group size that does (32, 64 or 128)"
                )
        return QuantizedKVLayout(fp, self)


class QuantizedKVLayout:
    """A model's KV slots quantized: the shape of its full-precision :class:`KVLayout`, and the
    bytes and buffers of ``quantization``'s packed values, scales and biases.

    Has what a pooled sequence needs of a layout (``SlotLayout``): block size, layers, bytes of
    a K and a V block, format tag.
    """

    def __init__(self, fp: KVLayout, quantization: KVQuantization) -> None:
        self.fp = fp
        self.quantization = quantization
        self.bits = quantization.bits
        self.group_size = quantization.group_size
        self.block_size = fp.block_size
        self.n_layers = fp.n_layers
        self.n_kv_heads = fp.n_kv_heads
        self.k_head_dim = fp.k_head_dim
        self.v_head_dim = fp.v_head_dim
        self.dtype = fp.dtype

    @property
    def format(self) -> str:
        return self.quantization.format

    def _slot_bytes(self, head_dim: int) -> int:
        """Bytes of one token slot of one layer's keys (or values) of ``head_dim``."""
        size = self.dtype.size
        return token_bytes(self.n_kv_heads, head_dim, 0, size, self.bits, self.group_size)

    @property
    def k_block_bytes(self) -> int:
        return self.n_layers * self.block_size * self._slot_bytes(self.k_head_dim)

    @property
    def v_block_bytes(self) -> int:
        return self.n_layers * self.block_size * self._slot_bytes(self.v_head_dim)

    def layer_layout(self, layer: int) -> KVLayout:
        """The full-precision shape of layer ``layer``'s keys and values (what a cache is
        given to write: it quantizes them)."""
        return self.fp

    def bytes_per_block(self, stream: str) -> int:
        """Bytes one block of ``stream`` ("k", "v", or "kv" for both) stands for."""
        if stream == "k":
            return self.k_block_bytes
        if stream == "v":
            return self.v_block_bytes
        if stream == "kv":
            return self.k_block_bytes + self.v_block_bytes
        raise ValueError(f"QuantizedKVLayout: stream must be 'k', 'v' or 'kv', got {stream!r}")

    def zeros(self, rows: int, n_slots: int, head_dim: int) -> tuple[mx.array, ...]:
        """An empty quantized buffer of ``rows`` x ``n_slots`` slots (zero words, scales and
        biases, as ``QuantizedKVCache`` allocates)."""
        shape = (rows, self.n_kv_heads, n_slots)
        per_word = 32 // self.bits
        return (
            mx.zeros((*shape, head_dim // per_word), mx.uint32),
            mx.zeros((*shape, head_dim // self.group_size), self.dtype),
            mx.zeros((*shape, head_dim // self.group_size), self.dtype),
        )

    def quantize(self, x: mx.array) -> tuple[mx.array, ...]:
        """``x`` (keys or values of the model's dtype) as mlx-lm's cache quantizes them."""
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def __repr__(self) -> str:
        return f"QuantizedKVLayout({self.format}, {self.fp!r})"


# -- buffers -------------------------------------------------------------------------------------


def buffer_map(fn: Callable[[mx.array], mx.array], buf: KVBuffer) -> KVBuffer:
    """``fn`` applied to ``buf`` (full precision) or to each of its parts (quantized)."""
    if isinstance(buf, tuple):
        return tuple(fn(part) for part in buf)
    return fn(buf)


def buffer_write(buf: KVBuffer, index: Any, value: KVBuffer) -> None:
    """``buf[index] = value``, part by part for a quantized buffer."""
    if isinstance(buf, tuple):
        assert isinstance(value, tuple), "a quantized buffer takes quantized values"
        for part, new in zip(buf, value, strict=True):
            part[index] = new
    else:
        assert not isinstance(value, tuple), "a full-precision buffer takes arrays"
        buf[index] = value


def buffer_concatenate(bufs: list[KVBuffer], axis: int = 0) -> KVBuffer:
    """The buffers joined along ``axis`` (all of one kind)."""
    parts = [b if isinstance(b, tuple) else (b,) for b in bufs]
    joined = tuple(mx.concatenate(list(same), axis=axis) for same in zip(*parts, strict=True))
    return joined if isinstance(bufs[0], tuple) else joined[0]


def buffer_nbytes(buf: KVBuffer) -> int:
    """Bytes of ``buf``'s arrays."""
    if isinstance(buf, tuple):
        return sum(part.nbytes for part in buf)
    return buf.nbytes


def buffer_slots(buf: KVBuffer) -> int:
    """Token slots of ``buf`` (its axis 2)."""
    first = buf[0] if isinstance(buf, tuple) else buf
    return int(first.shape[2])


def grown(buf: KVBuffer, n_new_slots: int) -> KVBuffer:
    """``buf`` with ``n_new_slots`` zero slots appended along the token axis (a copy)."""

    def grow(part: mx.array) -> mx.array:
        b, h, _, d = part.shape
        return mx.concatenate([part, mx.zeros((b, h, n_new_slots, d), part.dtype)], axis=2)

    return buffer_map(grow, buf)


def prefix(buf: KVBuffer, n: int) -> KVBuffer:
    """The first ``n`` token slots of ``buf`` (views)."""
    return buffer_map(lambda part: part[..., :n, :], buf)


# -- storage -------------------------------------------------------------------------------------


class QuantizedBlockStorage(MLXBlockStorage):
    """An :class:`MLXBlockStorage` whose blocks are quantized: each sequence's per-layer keys and
    values are ``(packed, scales, biases)`` triples of contiguous buffers, exactly
    ``len(block ids) * block_size`` slots long, so ``nbytes`` equals blocks held x bytes per
    block of the quantized format.

    Args:
        layout: The model's quantized layout.
        separate_kv: As :class:`MLXBlockStorage`'s.
    """

    def __init__(self, layout: QuantizedKVLayout, *, separate_kv: bool = True) -> None:
        super().__init__(layout.fp, separate_kv=separate_kv)
        self.quantized_layout = layout
        # What pooled sequences read: the quantized block size, bytes and format tag.
        self.layout = layout  # type: ignore[assignment]

    def _resize(self, seq: SequenceBuffers, n_blocks: int) -> None:
        layout = self.quantized_layout
        n_slots = n_blocks * layout.block_size
        if n_slots == 0:
            seq.keys, seq.values = [], []
            return
        if not seq.keys:
            seq.keys = [layout.zeros(1, n_slots, layout.k_head_dim) for _ in range(layout.n_layers)]
            seq.values = [
                layout.zeros(1, n_slots, layout.v_head_dim) for _ in range(layout.n_layers)
            ]
            return
        have = buffer_slots(seq.keys[0])
        if n_slots > have:
            seq.keys = [grown(buf, n_slots - have) for buf in seq.keys]
            seq.values = [grown(buf, n_slots - have) for buf in seq.values]
        elif n_slots < have:
            # A slice would keep the whole old buffer alive; a contiguous copy frees it.
            cut = lambda part: mx.contiguous(part[..., :n_slots, :])  # noqa: E731
            seq.keys = [buffer_map(cut, buf) for buf in seq.keys]
            seq.values = [buffer_map(cut, buf) for buf in seq.values]

    def read_block(self, block_id: int) -> dict[str, list[Any]]:
        """The memory of one block: its slots of every layer's (packed, scales, biases), as
        {"k": [...], "v": [...]} (see :meth:`MLXBlockStorage.read_block`)."""
        with self._lock:
            found = self._where.get(block_id)
        if found is None:
            raise KeyError(f"QuantizedBlockStorage: block {block_id} is not held by this storage")
        seq, index = found
        bs = self.layout.block_size
        window = (Ellipsis, slice(index * bs, (index + 1) * bs), slice(None))
        out: dict[str, list[Any]] = {}
        if not self.separate_kv or seq.k_block_ids[index] == block_id:
            out["k"] = [buffer_map(lambda p: p[window], buf) for buf in seq.keys]
        if not self.separate_kv or seq.v_block_ids[index] == block_id:
            out["v"] = [buffer_map(lambda p: p[window], buf) for buf in seq.values]
        return out

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(
                sum(buffer_nbytes(buf) for buf in seq.keys)
                + sum(buffer_nbytes(buf) for buf in seq.values)
                for seq in self._sequences.values()
            )
