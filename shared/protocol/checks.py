"""Checks of one field of a request: its type and range, or BadRequestError saying why.

Each check takes the value and the name to quote in the error (``op.argument``) and returns the
value as the daemon uses it. The error messages are part of the protocol's behaviour: clients and
tests read them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vqpool.shared.allocator import Owner
from vqpool.shared.errors import BadRequestError
from vqpool.shared.kv_formats import MAX_FORMATS, is_format
from vqpool.shared.protocol.limits import (
    INT64_MAX,
    INT64_MIN,
    MAX_BATCH,
    MAX_BYTES_PER_BLOCK,
    MAX_CLAIM_GROUPS,
    MAX_ITEMS,
    MAX_OWNER_LEN,
    MAX_TAG_LEN,
    MAX_TEXT_LEN,
)


def check_int(value: Any, name: str, lo: int = INT64_MIN, hi: int = INT64_MAX) -> int:
    """``value`` if it is an int (not a bool) in lo..hi, else BadRequestError."""
    if type(value) is not int or not lo <= value <= hi:
        raise BadRequestError(f"{name} must be an integer in {lo}..{hi}, got {short_repr(value)}")
    return value


def check_number(value: Any, name: str, lo: float, hi: float) -> float:
    """``value`` as a float if it is an int or float (not a bool) in lo..hi, else
    BadRequestError."""
    if type(value) not in (int, float) or not lo <= value <= hi:
        raise BadRequestError(f"{name} must be a number in {lo:g}..{hi:g}, got {short_repr(value)}")
    return float(value)


def int_in(lo: int, hi: int = INT64_MAX) -> Callable[[Any, str], int]:
    """The check of an int in lo..hi, for an argument's declaration."""
    return lambda value, name: check_int(value, name, lo, hi)


def number_in(lo: float, hi: float) -> Callable[[Any, str], float]:
    """The check of a number in lo..hi, for an argument's declaration."""
    return lambda value, name: check_number(value, name, lo, hi)


def check_str(value: Any, name: str, max_len: int = MAX_TEXT_LEN) -> str:
    """``value`` if it is a string of at most ``max_len`` characters, else BadRequestError."""
    if type(value) is not str or len(value) > max_len:
        raise BadRequestError(
            f"{name} must be a string of <= {max_len} chars, got {short_repr(value)}"
        )
    return value


def check_bool(value: Any, name: str) -> bool:
    """``value`` if it is a bool, else BadRequestError."""
    if type(value) is not bool:
        raise BadRequestError(f"{name} must be true or false, got {short_repr(value)}")
    return value


def check_owner(value: Any, name: str = "owner") -> Owner:
    """An owner id: a 64-bit int or a non-empty string of at most MAX_OWNER_LEN chars."""
    kind = type(value)
    if kind is int:
        if INT64_MIN <= value <= INT64_MAX:
            return value
    elif kind is str and 0 < len(value) <= MAX_OWNER_LEN:
        return value
    raise BadRequestError(
        f"{name} must be a 64-bit integer or a string of 1..{MAX_OWNER_LEN} chars, "
        f"got {short_repr(value)}"
    )


def check_tag(value: Any, name: str) -> str:
    """A stream or format tag: a non-empty string of at most MAX_TAG_LEN chars."""
    if type(value) is not str or not 0 < len(value) <= MAX_TAG_LEN:
        raise BadRequestError(
            f"{name} must be a string of 1..{MAX_TAG_LEN} chars, got {short_repr(value)}"
        )
    return value


def check_list(value: Any, name: str, max_len: int = MAX_ITEMS) -> list[Any]:
    """``value`` if it is an array of at most ``max_len`` items, else BadRequestError."""
    if type(value) is not list or len(value) > max_len:
        raise BadRequestError(
            f"{name} must be an array of <= {max_len} items, got {short_repr(value)}"
        )
    return value


def check_block_ids(value: Any, name: str = "block_ids") -> list[int]:
    """An array of block ids (non-negative ints)."""
    if type(value) is not list or len(value) > MAX_ITEMS:  # (every free: check_list inlined)
        check_list(value, name)
    ids: list[int] = value
    for block_id in ids:
        if type(block_id) is not int or not 0 <= block_id <= INT64_MAX:
            raise BadRequestError(
                f"{name} must hold block ids (ints >= 0), got {short_repr(block_id)}"
            )
    return ids


def check_updates(value: Any, name: str = "updates") -> list[tuple[int, int]]:
    """An array of ``[block_id, n_used]`` pairs (ranges of n_used are the allocator's to judge)."""
    pairs = check_list(value, name)
    updates: list[tuple[int, int]] = []
    for pair in pairs:
        if (
            type(pair) is not list
            or len(pair) != 2
            or type(pair[0]) is not int
            or type(pair[1]) is not int
            or not 0 <= pair[0] <= INT64_MAX
            or not INT64_MIN <= pair[1] <= INT64_MAX
        ):
            raise BadRequestError(
                f"{name} items must be [block_id, n_used] ints, got {short_repr(pair)}"
            )
        updates.append((pair[0], pair[1]))
    return updates


def check_allocations(value: Any, name: str = "items") -> list[tuple[str, int, Owner, str]]:
    """An array of ``[stream, n_tokens, owner, format]`` allocation items."""
    items = check_list(value, name, MAX_BATCH)
    parsed: list[tuple[str, int, Owner, str]] = []
    append = parsed.append
    for item in items:
        # One decode step may carry thousands of items: test the well-formed case inline and
        # leave the detailed message to the field checks.
        if type(item) is list and len(item) == 4:
            stream, n_tokens, owner, fmt = item
            if (
                type(stream) is str
                and 0 < len(stream) <= MAX_TAG_LEN
                and type(n_tokens) is int
                and INT64_MIN <= n_tokens <= INT64_MAX
                and type(fmt) is str
                and 0 < len(fmt) <= MAX_TAG_LEN
                and (
                    (type(owner) is int and INT64_MIN <= owner <= INT64_MAX)
                    or (type(owner) is str and 0 < len(owner) <= MAX_OWNER_LEN)
                )
            ):
                append((stream, n_tokens, owner, fmt))
                continue
            check_tag(stream, "stream")
            check_int(n_tokens, "n_tokens")
            check_owner(owner)
            check_tag(fmt, "format")
        raise BadRequestError(
            f"{name} items must be [stream, n_tokens, owner, format], got {short_repr(item)}"
        )
    return parsed


ClaimGroup = tuple[str, str, list[int], list[int] | None]
"""Blocks of one owner claimed together: stream, format, block ids, fills (None: all full)."""


def check_claims(value: Any, name: str = "owners") -> list[tuple[Owner, list[ClaimGroup]]]:
    """An array of ``[owner, [[stream, format, block_ids, fills or nil], ...]]`` claims.

    An owner with no group re-declares a registered owner that holds no block. At most
    MAX_ITEMS block ids in one message, all groups together.
    """
    entries = check_list(value, name, MAX_BATCH)
    parsed: list[tuple[Owner, list[ClaimGroup]]] = []
    n_ids = 0
    for entry in entries:
        if type(entry) is not list or len(entry) != 2:
            raise BadRequestError(f"{name} items must be [owner, groups], got {short_repr(entry)}")
        owner = check_owner(entry[0], f"{name}.owner")
        groups: list[ClaimGroup] = []
        for group in check_list(entry[1], f"{name}.groups", MAX_CLAIM_GROUPS):
            if type(group) is not list or len(group) != 4:
                raise BadRequestError(
                    f"{name} groups must be [stream, format, block_ids, fills], "
                    f"got {short_repr(group)}"
                )
            ids = check_block_ids(group[2], f"{name}.block_ids")
            fills = group[3]
            if fills is not None:
                fills = check_list(fills, f"{name}.fills")
                for n_used in fills:
                    check_int(n_used, f"{name}.fills", 0, INT64_MAX)
            n_ids += len(ids)
            groups.append(
                (check_tag(group[0], "stream"), check_tag(group[1], "format"), ids, fills)
            )
        parsed.append((owner, groups))
    if n_ids > MAX_ITEMS:
        raise BadRequestError(f"{name}: {n_ids} block ids in one claim; at most {MAX_ITEMS}")
    return parsed


def check_bytes_per_block(value: Any, name: str = "bytes_per_block") -> int | dict[str, int]:
    """Bytes one block holds in the worker (0..MAX_BYTES_PER_BLOCK): one int for every stream,
    or a map stream -> int."""
    if type(value) is int:
        return check_int(value, name, 0, MAX_BYTES_PER_BLOCK)
    if type(value) is not dict or len(value) > 8:
        raise BadRequestError(
            f"{name} must be an int or a map of <= 8 streams, got {short_repr(value)}"
        )
    return {
        check_tag(k, f"{name} key"): check_int(v, f"{name}[{k}]", 0, MAX_BYTES_PER_BLOCK)
        for k, v in value.items()
    }


def check_bytes_per_format(
    value: Any, name: str = "bytes_per_format"
) -> dict[str, int | dict[str, int]]:
    """Bytes one block of each format holds in the worker: a map of at most MAX_FORMATS format
    tags (:mod:`vqpool.shared.kv_formats`) to what :func:`check_bytes_per_block` takes."""
    if type(value) is not dict or len(value) > MAX_FORMATS:
        raise BadRequestError(
            f"{name} must be a map of <= {MAX_FORMATS} format tags, got {short_repr(value)}"
        )
    parsed: dict[str, int | dict[str, int]] = {}
    for tag, per_block in value.items():
        if not is_format(check_tag(tag, f"{name} key")):
            raise BadRequestError(
                f"{name} key {short_repr(tag)} is no KV format (fp32, fp16, bf16 or "
                "q{bits}g{group_size}: bits 4 or 8, group 32, 64 or 128)"
            )
        parsed[tag] = check_bytes_per_block(per_block, f"{name}[{tag}]")
    return parsed


def short_repr(value: Any) -> str:
    """A short description of a bad value for an error message (never the whole payload)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."
