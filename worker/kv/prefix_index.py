"""Finding the longest cached prefix of a token sequence: block chain keys and the match walk,
shared by the prompt cache's memory tier and its disk tier.

Block ``i`` of a token sequence has the key ``hash((key of block i-1, its block_size ids))``
(ints and tuples of ints hash the same in every process). An index maps each whole block's key
to the entries holding that prefix; a lookup walks the prompt's blocks while their keys are
indexed, extends the match token by token into the next block of the entries found, then
compares the prefix's token ids once: a hash collision is a miss, never a wrong hit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar


class HoldsTokens(Protocol):
    """An indexed entry: the token ids it holds."""

    @property
    def tokens(self) -> tuple[int, ...]: ...


EntryT = TypeVar("EntryT", bound=HoldsTokens)


def block_keys(tokens: Sequence[int], n_blocks: int, block_size: int) -> list[int]:
    """The chain keys of the first ``n_blocks`` whole blocks of ``tokens``."""
    keys: list[int] = []
    key = 0
    for i in range(n_blocks):
        key = hash((key, tuple(tokens[i * block_size : (i + 1) * block_size])))
        keys.append(key)
    return keys


def index_add(index: dict[int, dict[EntryT, None]], entry: EntryT, keys: list[int]) -> None:
    """Index ``entry`` under each of its whole blocks' ``keys``."""
    for key in keys:
        index.setdefault(key, {})[entry] = None


def index_remove(index: dict[int, dict[EntryT, None]], entry: EntryT, keys: list[int]) -> None:
    """Take ``entry`` out of ``index`` (keys no entry holds any more go)."""
    for key in keys:
        holders = index.get(key)
        if holders is not None:
            holders.pop(entry, None)
            if not holders:
                del index[key]


def prefixes_of(
    index: Mapping[int, Mapping[EntryT, None]],
    tokens: tuple[int, ...],
    keys: list[int],
    block_size: int,
) -> list[EntryT]:
    """The indexed entries (other than one holding exactly ``tokens``) whose tokens are a
    prefix of ``tokens`` (``keys``: its whole blocks' keys): an entry for ``tokens`` answers
    every lookup they answer."""
    found: list[EntryT] = []
    for depth, key in enumerate(keys, start=1):
        for other in index.get(key, ()):
            held = other.tokens
            if len(held) // block_size == depth and held != tokens and held == tokens[: len(held)]:
                found.append(other)
    return found


def longest_match(
    index: Mapping[int, Mapping[EntryT, None]],
    tokens: Sequence[int],
    max_tokens: int,
    block_size: int,
) -> tuple[EntryT | None, int]:
    """The entry of ``index`` holding the longest prefix of ``tokens`` (at most ``max_tokens``)
    and that prefix's length; (None, 0) when none. At least one whole block must match.

    Whole blocks are found by key; then, among the entries holding them, the one whose next
    (possibly partial) block shares the most tokens with ``tokens`` extends the match token by
    token (the most recently indexed first among equals).
    """
    bs = block_size
    key = 0
    holders: Mapping[EntryT, None] | None = None
    depth = 0
    for i in range(max_tokens // bs):
        key = hash((key, tuple(tokens[i * bs : (i + 1) * bs])))
        found = index.get(key)
        if not found:
            break
        holders, depth = found, i + 1
    if holders is None:
        return None, 0
    start = depth * bs
    wanted = tuple(tokens[start:max_tokens])
    best: EntryT | None = None
    best_n = -1
    for entry in reversed(list(holders)):
        tail = entry.tokens[start : start + bs]
        n = 0
        for mine, theirs in zip(tail, wanted, strict=False):
            if mine != theirs:
                break
            n += 1
        if n > best_n:
            best, best_n = entry, n
    assert best is not None
    n_tokens = start + best_n
    if best.tokens[:n_tokens] != tuple(tokens[:n_tokens]):
        return None, 0  # a hash collision: a miss, never a wrong hit
    return best, n_tokens
