"""What a loaded model's worker process holds in memory, measured: its weights' bytes (the
parameters as loaded), MLX's active, cache and peak memory, and the process's resident set;
and the bound on MLX's buffer cache (``--mlx-cache-limit``).

The heartbeat sends a sample (:meth:`MemoryProbe.sample`) in its ``ping`` (``memory``); the
daemon shows it beside what its ledger counts for the model (docs/budget.md, "Declared and
measured memory").
"""

from __future__ import annotations

from typing import cast

import mlx.core as mx
import mlx.nn as nn
import psutil
from mlx.utils import tree_flatten
from vqpool.shared.protocol import MAX_MEMORY_BYTES


def weights_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters: the sum of their ``nbytes`` (quantized weights, scales
    and biases count as stored)."""
    flat = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    return sum(array.nbytes for _, array in flat)


def apply_cache_limit(n_bytes: int) -> None:
    """Bound MLX's buffer cache to ``n_bytes`` (0: no cache): freed buffers past it go back to
    the system at the next allocation instead of waiting for reuse."""
    mx.set_cache_limit(n_bytes)


class MemoryProbe:
    """Samples this process's memory, for a model of ``weights`` bytes."""

    def __init__(self, weights: int) -> None:
        self.weights = weights
        self._process = psutil.Process()

    def sample(self) -> dict[str, int]:
        """The ``ping`` ``memory`` map now, each figure capped at the protocol's bound (a
        figure past 1 PiB is an error of the source, and the daemon would refuse the ping)."""
        figures = {
            "weights": self.weights,
            "mlx_active": mx.get_active_memory(),
            "mlx_cache": mx.get_cache_memory(),
            "mlx_peak": mx.get_peak_memory(),
            "rss": self._process.memory_info().rss,
        }
        return {name: min(max(0, int(n)), MAX_MEMORY_BYTES) for name, n in figures.items()}
