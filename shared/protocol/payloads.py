"""Payload shapes both ends read and write: allocator stats, pool config, block rows, and how
a session id is shown to people."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from vqpool.shared.allocator import AllocationStats, Block, PoolConfig

_STATS_FIELDS = (
    "n_blocks",
    "n_allocations",
    "n_frees",
    "n_reused",
    "n_exhausted",
    "n_grown",
    "n_retired",
    "peak_blocks_in_use",
)
"""The AllocationStats counters that travel under their own names, in its field order; its
private ``_fragmented_count`` follows as ``fragmented_count``."""

_CONFIG_FIELDS = ("block_size", "n_blocks", "separate_kv", "grow_on_exhaustion", "max_blocks")
"""The PoolConfig fields, each under its own name on the wire."""


def stats_to_wire(stats: AllocationStats) -> dict[str, int]:
    """An AllocationStats as a map (``fragmented_count`` is the seed's private counter)."""
    wire = {name: getattr(stats, name) for name in _STATS_FIELDS}
    wire["fragmented_count"] = stats._fragmented_count
    return wire


def stats_from_wire(data: Mapping[str, int]) -> AllocationStats:
    """The AllocationStats a :func:`stats_to_wire` map describes."""
    counters = {name: data[name] for name in _STATS_FIELDS}
    return AllocationStats(**counters, _fragmented_count=data["fragmented_count"])


def config_to_wire(config: PoolConfig) -> dict[str, Any]:
    """A PoolConfig as a map."""
    return {name: getattr(config, name) for name in _CONFIG_FIELDS}


def config_from_wire(data: Mapping[str, Any]) -> PoolConfig:
    """The PoolConfig a :func:`config_to_wire` map describes."""
    return PoolConfig(**{name: data[name] for name in _CONFIG_FIELDS})


def block_rows(blocks: Iterable[Block]) -> list[list[Any]]:
    """Blocks as ``[block_id, stream, format, n_used]`` rows (the owner is implied)."""
    return [[b.block_id, b.stream, b.format, b.n_used] for b in blocks]


def session_label(sid: int) -> str:
    """How a session id is shown to people: hex, the same in the daemon's log, its error
    messages, vqpoolctl and the worker's ``/health`` (the wire carries the int)."""
    return f"{sid:x}"
