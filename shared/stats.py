"""Allocation counters and their Prometheus text, as the seed allocator defines them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class AllocationStats:
    """Running counters for a :class:`BlockPoolAllocator`, cumulative since construction.

    Attributes:
        n_blocks: Blocks the pool manages now.
        n_allocations: Blocks handed out by successful allocate() calls.
        n_frees: Blocks returned by free()/free_all().
        n_reused: Allocated blocks that had been handed out before (not fresh ids).
        n_exhausted: allocate() calls that failed for want of free blocks.
        n_grown: Blocks added by exhaustion-triggered growth.
        n_retired: Blocks removed for good by shrink().
        peak_blocks_in_use: High-water mark of blocks allocated at once.
    """

    n_blocks: int
    n_allocations: int = 0
    n_frees: int = 0
    n_reused: int = 0
    n_exhausted: int = 0
    n_grown: int = 0
    n_retired: int = 0
    peak_blocks_in_use: int = 0
    _fragmented_count: int = field(default=0, repr=False)

    def blocks_in_use(self) -> int:
        """Blocks allocated now."""
        return self.n_allocations - self.n_frees

    def fragmentation(self) -> float:
        """Fraction of the pool's blocks that are allocated but not full (0.0 for no blocks)."""
        if self.n_blocks == 0:
            return 0.0
        return self._fragmented_count / self.n_blocks

    def snapshot(self) -> AllocationStats:
        """An independent copy, for history and export."""
        return AllocationStats(
            self.n_blocks,
            self.n_allocations,
            self.n_frees,
            self.n_reused,
            self.n_exhausted,
            self.n_grown,
            self.n_retired,
            self.peak_blocks_in_use,
            self._fragmented_count,
        )

    def to_prometheus(self, prefix: str = "veloxquant_block_pool") -> str:
        """These stats in the Prometheus text exposition format, newline-terminated.

        The metric names, types and order are the seed's, so existing dashboards keep working.
        """
        gauges = (
            ("blocks_in_use", str(self.blocks_in_use())),
            ("blocks_total", str(self.n_blocks)),
            ("fragmentation", f"{self.fragmentation():.6f}"),
            ("peak_blocks_in_use", str(self.peak_blocks_in_use)),
        )
        counters = (
            ("allocations_total", self.n_allocations),
            ("frees_total", self.n_frees),
            ("reused_total", self.n_reused),
            ("exhausted_total", self.n_exhausted),
            ("grown_total", self.n_grown),
            ("retired_total", self.n_retired),
        )
        lines: list[str] = []
        for name, text in gauges:
            lines += [f"# TYPE {prefix}_{name} gauge", f"{prefix}_{name} {text}"]
        for name, value in counters:
            lines += [f"# TYPE {prefix}_{name} counter", f"{prefix}_{name} {value}"]
        return "\n".join(lines) + "\n"

    def __repr__(self) -> str:
        return (
            f"AllocationStats(in_use={self.blocks_in_use()}/{self.n_blocks}, "
            f"allocations={self.n_allocations}, frees={self.n_frees}, "
            f"reused={self.n_reused}, exhausted={self.n_exhausted}, "
            f"grown={self.n_grown}, retired={self.n_retired}, "
            f"peak={self.peak_blocks_in_use}, fragmentation={self.fragmentation():.3f})"
        )
