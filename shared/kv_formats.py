"""The KV block formats the pool knows, by tag, and what one token of each costs in bytes.

A block's ``format`` tag says how its keys and values are stored. Full precision keeps the
model's dtype: "fp32", "fp16", "bf16". A quantized format is ``q{bits}g{group_size}`` ("q8g64",
"q4g32", ...): mlx-lm's ``QuantizedKVCache`` (``mx.quantize``, affine mode) packs each head's
values to ``bits`` bits in uint32 words and keeps a scale and a bias per ``group_size`` values,
in the model's dtype. The worker declares each format's bytes per block at hello
(``bytes_per_format``) and the ledger charges each block the bytes of its own format, so blocks
of several formats share one pool and one budget.
"""

from __future__ import annotations

import re

FULL_PRECISION_FORMATS: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2}
"""Each full-precision tag and the bytes of one of its elements."""

QUANTIZED_BITS = (4, 8)
"""Bits per value a quantized format may pack (mlx_lm.server's ``--kv-bits``)."""

QUANTIZED_GROUP_SIZES = (32, 64, 128)
"""Values per scale and bias a quantized format may group (``--kv-group-size``)."""

DEFAULT_GROUP_SIZE = 64
"""mlx-lm's ``--kv-group-size`` default."""

MAX_FORMATS = 8
"""Most formats one hello may declare bytes for."""

_QUANTIZED_TAG = re.compile(r"q(\d+)g(\d+)")


def quantized_format(bits: int, group_size: int = DEFAULT_GROUP_SIZE) -> str:
    """The tag of ``bits``-bit values grouped by ``group_size``, e.g. "q4g64".

    Raises:
        ValueError: bits not in QUANTIZED_BITS or group_size not in QUANTIZED_GROUP_SIZES.
    """
    if bits not in QUANTIZED_BITS or isinstance(bits, bool):
        raise ValueError(f"KV bits must be one of {QUANTIZED_BITS}, got {bits!r}")
    if group_size not in QUANTIZED_GROUP_SIZES or isinstance(group_size, bool):
        raise ValueError(
            f"KV group size must be one of {QUANTIZED_GROUP_SIZES}, got {group_size!r}"
        )
    return f"q{bits}g{group_size}"


def parse_format(tag: str) -> tuple[int, int] | None:
    """``(bits, group_size)`` of a quantized tag; None for a full-precision one.

    Raises:
        ValueError: ``tag`` names no format the pool knows.
    """
    if tag in FULL_PRECISION_FORMATS:
        return None
    match = _QUANTIZED_TAG.fullmatch(tag)
    if match is not None:
        bits, group_size = int(match[1]), int(match[2])
        if (
            bits in QUANTIZED_BITS
            and group_size in QUANTIZED_GROUP_SIZES
            and f"q{bits}g{group_size}" == tag  # not "q08g64"
        ):
            return bits, group_size
    raise ValueError(
        f"unknown KV format {tag!r}: one of {sorted(FULL_PRECISION_FORMATS)} or "
        f"q{{bits}}g{{group}} with bits in {QUANTIZED_BITS} and group in {QUANTIZED_GROUP_SIZES}"
    )


def is_format(tag: str) -> bool:
    """Whether ``tag`` names a format the pool knows."""
    try:
        parse_format(tag)
    except ValueError:
        return False
    return True


def token_bytes(
    n_kv_heads: int,
    k_head_dim: int,
    v_head_dim: int,
    element_bytes: int,
    bits: int | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> int:
    """Bytes one token of one layer's keys and values takes: full precision (``bits`` None)
    ``n_kv_heads * (k_head_dim + v_head_dim) * element_bytes``; quantized, per head and per K
    or V, ``head_dim * bits / 8`` bytes of packed values plus ``head_dim / group_size`` scales
    and as many biases of ``element_bytes`` each (the model's dtype, as mlx-lm keeps them).

    Raises:
        ValueError: A bad bits / group_size pair, or a head_dim not divisible by group_size
            (``mx.quantize`` refuses it too).
    """
    if bits is None:
        return n_kv_heads * (k_head_dim + v_head_dim) * element_bytes
    quantized_format(bits, group_size)
    total = 0
    for head_dim in (k_head_dim, v_head_dim):
        if head_dim % group_size:
            raise ValueError(
                f"a head of {head_dim} dims cannot be quantized in groups of {group_size}"
            )
        total += head_dim * bits // 8 + 2 * (head_dim // group_size) * element_bytes
    return n_kv_heads * total
