"""What a request waited for before its model served it, sent back in its response's headers so
that a client (scripts/bench_models.py) can split its time to first token: the load it waited
for, of that the time the load waited for memory, and of that the time only models inside
their ``min_residency`` could have made room."""

from __future__ import annotations

from dataclasses import dataclass

LOAD_WAIT_HEADER = "X-Vqpool-Load-Wait"
MEMORY_WAIT_HEADER = "X-Vqpool-Memory-Wait"
RESIDENCY_WAIT_HEADER = "X-Vqpool-Residency-Wait"


@dataclass(frozen=True)
class LoadWait:
    """Seconds one request waited in the front door before its model served it.

    Attributes:
        total: From its arrival to its model's serving it (0: the model was loaded).
        memory: Of ``total``, the part its load spent getting bytes (asking the ledger,
            unloading idle models, waiting for a change) before its worker started.
        residency: Of ``memory``, the part when only models loaded less than
            ``min_residency`` seconds ago could have made room.
    """

    total: float = 0.0
    memory: float = 0.0
    residency: float = 0.0

    @classmethod
    def split(cls, total: float, worker_start: float, residency: float) -> LoadWait:
        """The wait of a request that waited ``total`` seconds for a load whose worker took
        ``worker_start`` seconds to serve and which waited ``residency`` seconds for models
        inside their residency: what came before the worker's start was the wait for memory
        (or for its room under ``max_loaded``)."""
        memory = max(0.0, total - worker_start)
        return cls(total, memory, min(memory, residency))

    def headers(self) -> dict[str, str]:
        return {
            LOAD_WAIT_HEADER: f"{self.total:.3f}",
            MEMORY_WAIT_HEADER: f"{self.memory:.3f}",
            RESIDENCY_WAIT_HEADER: f"{self.residency:.3f}",
        }
