"""The pool's gauges and counters in the Prometheus text exposition format (blocks total, in
use and peak, fragmentation; blocks allocated, freed, reused, grown and retired, allocations
refused), named veloxquant_block_pool_* as the VeloxQuant block pool exports them."""

from __future__ import annotations

from typing import Any

from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.protocol import Field

PARAMS: tuple[Field, ...] = ()


def run(state: DaemonState, args: dict[str, Any]) -> str:
    coord = state.coord
    return coord.allocator.stats.to_prometheus()
