"""What this machine's memory allows: its physical memory (what ``--budget 40%`` is a share of)
and the budget ``vqpool serve`` gives a vqpoold it starts when nobody chose one.

The default budget is 75% of the memory models can use, leaving the system room:

* macOS: 75% of Metal's recommended working set (``max_recommended_working_set_size``), the most
  the GPU keeps resident without paging. macOS already sets it below physical memory (about
  two thirds of a 16 GB Mac, three quarters of a larger one), so the other applications keep
  the rest; the 25% kept back from it is for what every worker holds outside the ledger: its
  Python and MLX runtime, a prefill's activations and MLX's buffer cache.
* Linux (no Metal): 75% of physical memory less 2 GiB for the system, for the same reasons.

Never under :data:`MIN_DEFAULT_BUDGET` (or half of physical memory, if that is less): a small
machine still gets a budget that serves a tiny model.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import psutil
from vqpool.shared.byte_sizes import format_bytes

DEFAULT_SHARE = 0.75
"""The share of the memory models can use that the default budget takes."""
SYSTEM_ROOM = 2 * 2**30
"""Bytes of physical memory left to the system on Linux before the share is taken."""
MIN_DEFAULT_BUDGET = 2**30
"""The smallest default budget, unless half the machine's memory is smaller still."""
ROUNDING = 2**20
"""The default budget is a whole number of MiB, so it prints plainly."""


@dataclass(frozen=True)
class DefaultBudget:
    """The budget chosen for a daemon started without one.

    Attributes:
        nbytes: The budget in bytes.
        basis: How it was found, for people: ``75% of Metal's recommended working set (16 GiB)``.
    """

    nbytes: int
    basis: str


def physical_memory() -> int:
    """This machine's physical memory in bytes."""
    return int(psutil.virtual_memory().total)


def metal_working_set() -> int | None:
    """Metal's recommended working set in bytes on macOS; None elsewhere (or without Metal)."""
    if sys.platform != "darwin":
        return None
    import mlx.core as mx

    if not mx.metal.is_available():
        return None
    size = mx.device_info(mx.gpu).get("max_recommended_working_set_size")
    return size if isinstance(size, int) and size > 0 else None


def default_budget(physical: int, working_set: int | None) -> DefaultBudget:
    """The default budget of a machine with ``physical`` bytes of memory and, on macOS, Metal's
    recommended ``working_set`` (see the module docstring)."""
    if working_set is not None:
        share = int(working_set * DEFAULT_SHARE)
        basis = (
            f"{DEFAULT_SHARE:.0%} of Metal's recommended working set ({format_bytes(working_set)})"
        )
    else:
        share = int(max(0, physical - SYSTEM_ROOM) * DEFAULT_SHARE)
        basis = (
            f"{DEFAULT_SHARE:.0%} of physical memory ({format_bytes(physical)}) less "
            f"{format_bytes(SYSTEM_ROOM)} for the system"
        )
    floor = min(MIN_DEFAULT_BUDGET, physical // 2)
    if share < floor:
        share = floor
        basis = f"the smallest default, {basis} being less"
    return DefaultBudget(share // ROUNDING * ROUNDING, basis)


def machine_default_budget() -> DefaultBudget:
    """The default budget of this machine."""
    return default_budget(physical_memory(), metal_working_set())
