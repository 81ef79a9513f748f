"""Declared against measured memory, per model: what its workers' processes hold, as their
heartbeats last reported it (``ping``'s ``memory``), beside what the daemon counts for it (the
KV bytes its sessions hold plus the weights its workers report), and the warning when the two
drift apart. Nothing here changes a charge: it is for the operator's eyes (docs/budget.md,
"Declared and measured memory").
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vqpool.daemon.core.sessions import Session
from vqpool.shared.byte_sizes import format_bytes
from vqpool.shared.protocol import MEMORY_KEYS, measured_bytes

log = logging.getLogger("vqpoold")

DRIFT_FRACTION = 0.25
"""Measured and declared drift apart when they differ by more than this share of declared..."""

DRIFT_FLOOR = 128 << 20
"""...and by more than 128 MiB: room for what a worker holds that no ledger charges when it
behaves, MLX's buffer cache (64 MiB by default, ``--mlx-cache-limit``) and one step's transient
arrays, so a tiny model's few megabytes do not warn for its runtime's own buffers. The share
covers transients that grow with the model (a prefill chunk's activations) and the runtime's
allocation slack; past both, the worker holds memory the budget does not know of (a cache
limit set too high, a leak, weights loaded twice) or the budget counts memory it does not."""

DRIFT_WARNING_GAP = 300.0
"""Seconds between two drift warnings of one model: a model whose measured memory swings
across the margin (a long prefill's transients come and go) warns once per five minutes at
most, however many episodes begin."""


@dataclass(slots=True)
class ModelMemory:
    """One model's memory, declared and measured.

    Attributes:
        kv_held: KV bytes its sessions hold (the ledger's charge).
        reports: Each reporting worker process's last report, by pid (a process with several
            sessions of the model counts once).
    """

    kv_held: int
    reports: dict[int, dict[str, int]]

    def figures(self) -> dict[str, int]:
        """The reports' figures summed over the processes, and ``measured``."""
        total = dict.fromkeys(MEMORY_KEYS, 0)
        for report in self.reports.values():
            for name in MEMORY_KEYS:
                total[name] += report[name]
        total["measured"] = sum(measured_bytes(r) for r in self.reports.values())
        return total

    def view(self) -> dict[str, Any]:
        """The ``memory`` of a ``model_list`` row: the summed figures, ``declared`` (KV held
        plus weights), ``difference`` (measured less declared), the ``margin`` it may reach
        either way, ``drift`` (whether it is past it) and ``processes`` reporting."""
        figures = self.figures()
        declared = self.kv_held + figures["weights"]
        margin = drift_margin(declared)
        difference = figures["measured"] - declared
        return {
            **figures,
            "kv_held": self.kv_held,
            "declared": declared,
            "difference": difference,
            "margin": margin,
            "drift": abs(difference) > margin,
            "processes": len(self.reports),
        }


def drift_margin(declared: int) -> int:
    """How far measured may be from ``declared`` bytes before they drift apart."""
    return max(DRIFT_FLOOR, int(declared * DRIFT_FRACTION))


def model_memory(sessions: Iterable[Session], model: str, kv_held: int) -> ModelMemory | None:
    """``model``'s memory from the last reports of its ``sessions``; None when none reported."""
    reports = {s.pid: s.memory for s in sessions if s.model == model and s.memory is not None}
    return ModelMemory(kv_held, reports) if reports else None


class DriftWatch:
    """Warns in the daemon's log when a model's measured memory drifts from its declared:
    once per drift episode (it ends when the two agree again) and at most once per
    DRIFT_WARNING_GAP per model while it is served (its state goes with its last session, so
    it stays as small as the models served)."""

    def __init__(self) -> None:
        self._drifting: set[str] = set()
        self._warned_at: dict[str, float] = {}

    def forget(self, model: str) -> None:
        """``model``'s last session ended."""
        self._drifting.discard(model)
        self._warned_at.pop(model, None)

    def check(self, model: str, memory: ModelMemory | None, now: float) -> None:
        """Compare ``model``'s ``memory`` (None: nothing reported) at monotonic time ``now``."""
        view = None if memory is None else memory.view()
        if view is None or not view["drift"]:
            self._drifting.discard(model)
            return
        if model in self._drifting:
            return
        self._drifting.add(model)
        last = self._warned_at.get(model)
        if last is not None and now - last < DRIFT_WARNING_GAP:
            return
        self._warned_at[model] = now
        log.warning(
            "model %r: measured memory %s differs from declared %s (KV held %s + weights %s) by "
            "%s, past the margin of %s: its workers hold memory the budget does not count, or "
            "the budget counts memory they do not hold (`vqpoolctl model list --json` shows "
            "the figures)",
            model,
            format_bytes(view["measured"]),
            format_bytes(view["declared"]),
            format_bytes(view["kv_held"]),
            format_bytes(view["weights"]),
            format_bytes(abs(view["difference"])),
            format_bytes(view["margin"]),
        )
