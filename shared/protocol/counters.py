"""Figures a worker reports to the daemon in its load report, declared once for both ends.

The worker's prompt cache sends them (``ping``'s ``prompt_cache``), the daemon checks them
(:func:`check_prompt_cache`) and exports them as metrics, ``vqpoolctl`` sums them per model.
Likewise what the worker's process holds in memory (``ping``'s ``memory``,
:func:`check_memory`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vqpool.shared.errors import BadRequestError
from vqpool.shared.protocol.checks import check_int, short_repr
from vqpool.shared.protocol.limits import MAX_MEMORY_BYTES


@dataclass(frozen=True, slots=True)
class ReportedFigure:
    """One figure of a report: its name on the wire, whether it is a running count (it only
    grows, and starts over with the worker) or a level (what is held now), and what it says."""

    name: str
    running_count: bool
    help: str


PROMPT_CACHE_FIGURES: tuple[ReportedFigure, ...] = (
    ReportedFigure("bytes", False, "Bytes the workers' prompt caches hold."),
    ReportedFigure(
        "blocks",
        False,
        "Blocks the workers' prompt caches hold (part of vqpool_model_blocks_held).",
    ),
    ReportedFigure("entries", False, "Entries of the workers' prompt caches."),
    ReportedFigure("lookups", True, "Requests that looked up a prompt cache."),
    ReportedFigure("hits", True, "Lookups that reused a cached prefix."),
    ReportedFigure(
        "tokens_reused", True, "Prompt tokens taken from a prompt cache instead of being prefilled."
    ),
    ReportedFigure(
        "tokens_prefilled",
        True,
        "Prompt tokens prefilled by requests that looked up a prompt cache.",
    ),
    ReportedFigure("evictions", True, "Prompt-cache entries given back."),
    ReportedFigure("disk_bytes", False, "Bytes of prompt-cache entries on disk (--kv-disk-bytes)."),
    ReportedFigure("disk_entries", False, "Prompt-cache entries on disk."),
    ReportedFigure("disk_reads", True, "Prompt-cache entries read back from disk."),
    ReportedFigure("disk_writes", True, "Evicted prompt-cache entries written to disk."),
    ReportedFigure(
        "disk_dropped_writes",
        True,
        "Evicted prompt-cache entries not written: the disk writer's queue was full.",
    ),
    ReportedFigure(
        "disk_hit_tokens", True, "Prompt tokens of lookups answered by an entry read from disk."
    ),
)
"""What a worker's load report may say of its prompt cache (``ping``'s ``prompt_cache``)."""

PROMPT_CACHE_COUNTERS = tuple(figure.name for figure in PROMPT_CACHE_FIGURES)
"""The names of :data:`PROMPT_CACHE_FIGURES`, in order."""


def check_prompt_cache(value: Any, name: str = "prompt_cache") -> dict[str, int]:
    """A worker's prompt-cache report: a map of names of PROMPT_CACHE_COUNTERS to ints >= 0
    (absent names read 0)."""
    if type(value) is not dict:
        raise BadRequestError(f"{name} must be a map, got {short_repr(value)}")
    unknown = sorted(str(k) for k in value.keys() - set(PROMPT_CACHE_COUNTERS))
    if unknown:
        raise BadRequestError(f"{name}: unknown counter(s) {unknown}")
    return {k: check_int(value.get(k, 0), f"{name}.{k}", 0) for k in PROMPT_CACHE_COUNTERS}


MEMORY_FIGURES: tuple[ReportedFigure, ...] = (
    ReportedFigure(
        "weights", False, "Bytes of the model's parameters in its workers (as they loaded them)."
    ),
    ReportedFigure(
        "mlx_active", False, "Bytes MLX holds in live arrays (weights, KV buffers, transients)."
    ),
    ReportedFigure(
        "mlx_cache", False, "Bytes of freed buffers MLX keeps for reuse (its buffer cache)."
    ),
    ReportedFigure("mlx_peak", False, "Most bytes MLX held in live arrays since the start."),
    ReportedFigure("rss", False, "Resident set of the worker processes."),
)
"""What a worker's load report says of its process's memory (``ping``'s ``memory``), in bytes."""

MEMORY_KEYS = tuple(figure.name for figure in MEMORY_FIGURES)
"""The names of :data:`MEMORY_FIGURES`, in order."""


def check_memory(value: Any, name: str = "memory") -> dict[str, int]:
    """A worker's memory report: a map of names of MEMORY_KEYS to byte counts in
    0..MAX_MEMORY_BYTES (absent names read 0)."""
    if type(value) is not dict:
        raise BadRequestError(f"{name} must be a map, got {short_repr(value)}")
    unknown = sorted(str(k) for k in value.keys() - set(MEMORY_KEYS))
    if unknown:
        raise BadRequestError(f"{name}: unknown figure(s) {unknown}")
    return {k: check_int(value.get(k, 0), f"{name}.{k}", 0, MAX_MEMORY_BYTES) for k in MEMORY_KEYS}


def measured_bytes(report: dict[str, int]) -> int:
    """What a memory report says its process holds: MLX's active plus cached bytes, or the
    resident set when MLX reports none (a build whose allocator does not count)."""
    mlx = report["mlx_active"] + report["mlx_cache"]
    return mlx if mlx else report["rss"]
