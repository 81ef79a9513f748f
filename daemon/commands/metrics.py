"""The pool's counters in the Prometheus text exposition format (the seed's metric names:
veloxquant_block_pool_*)."""

from __future__ import annotations

from typing import Any

from vqpool.daemon.coordinator import Coordinator
from vqpool.shared.protocol import Field

PARAMS: tuple[Field, ...] = ()


def run(coord: Coordinator, args: dict[str, Any]) -> str:
    return coord.allocator.stats.to_prometheus()
