"""The front door's calls on vqpoold's ledger around a load: what a load asks for (its weights and
its KV minimum), the reservation (``load_reserve``) and its release, and the budget's totals.

Each call opens its own admin connection in a thread (``asyncio.to_thread``), so the event loop
never blocks on the daemon; the supervisor makes every decision from the answers.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vqpool.shared.admin_client import AdminClient
from vqpool.shared.byte_sizes import format_bytes
from vqpool.shared.kv_sequence import SequenceQuantization, sequence_bytes
from vqpool.shared.kv_size import kv_block_bytes

DEFAULT_LOAD_KV_TOKENS = 2048
"""Tokens of KV a load asks room for beside its weights (``--load-kv-tokens``), unless the
model's reserve is larger: one request of a chat's usual length. Less lets a budget fill with
weights and leaves the loaded models' requests waiting for blocks (scripts/bench_models.py
measured it: with room for two blocks, three models' weights took 166 of 167 MiB)."""
MAX_LOAD_KV_TOKENS = 1 << 20
CALL_TIMEOUT = 5.0
"""Seconds one admin call may take."""
MAX_TICKET_TTL = 600.0
"""The longest a reservation may wait for its worker's hello (the daemon's bound)."""
CACHE_RELEASE_WAIT = 2.0
"""Seconds a load waits for the prompt-cache bytes the daemon asked workers to release."""


@dataclass(frozen=True)
class LoadNeed:
    """What loading a model asks the ledger for: its weights, its worker's overhead (its MLX
    buffer-cache limit) and its KV minimum (the larger of its reserve and the KV of
    ``--load-kv-tokens`` tokens, in whole blocks)."""

    weights: int
    kv_min: int
    overhead: int = 0


@dataclass(frozen=True)
class Shortfall:
    """A reservation the ledger could not grant now (``load_reserve``'s answer)."""

    short: int
    free: int
    weights: int
    kv_min: int
    cached: int
    """Prompt-cache bytes the daemon just asked workers to release for it."""
    overhead: int = 0

    def message(self, model: str) -> str:
        fb = format_bytes
        overhead = f", {fb(self.overhead)} of overhead" if self.overhead else ""
        return (
            f"loading {model} needs {fb(self.weights)} of weights{overhead} and "
            f"{fb(self.kv_min)} of KV; {fb(max(0, self.free))} free now, {fb(self.short)} short"
        )


class LedgerCalls:
    """The ledger calls of the front door on ``run_dir``'s vqpoold."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    async def call(self, op: str, **args: Any) -> Any:
        """Run admin op ``op`` off the event loop.

        Raises:
            VqpoolError: The daemon refused it or does not answer.
        """

        def run() -> Any:
            with AdminClient(self.run_dir, timeout=CALL_TIMEOUT) as admin:
                return admin.call(op, **args)

        return await asyncio.to_thread(run)

    async def need(
        self,
        model: str,
        spec: str,
        weights: int | None,
        kv_tokens: int,
        overhead: int = 0,
        quantization: tuple[int, int] | None = None,
        holding: SequenceQuantization | None = None,
    ) -> LoadNeed:
        """What loading ``model`` (``spec`` names its files) asks for: ``weights`` (unknown: 0,
        its worker's hello charges them), ``overhead``, and its KV minimum: what one sequence
        of ``kv_tokens`` tokens needs at its smallest (its config priced at the pool's block
        size; when its worker quantizes KV to ``quantization``'s (bits, group_size), held as
        ``holding`` says: :func:`vqpool.shared.kv_sequence.sequence_bytes`) but no more than
        its limit at the daemon, or its reserve there if larger.

        Raises:
            VqpoolError: The daemon does not answer.
        """
        block_size = (await self.call("stats"))["config"]["block_size"]
        fp_block = kv_block_bytes(spec, block_size) or 0
        quantized_block = None
        if quantization is not None:
            try:
                quantized_block = kv_block_bytes(spec, block_size, *quantization)
            except ValueError:  # heads the group does not divide: the worker refuses it
                quantized_block = None
        holding = holding or SequenceQuantization()
        room = sequence_bytes(kv_tokens, block_size, fp_block, quantized_block, holding)
        models = await self.call("model_list")
        row = next((m for m in models["models"] if m["model"] == model), None)
        if row is None:
            return LoadNeed(weights or 0, room, overhead)
        kv_min = max(row["reserve"], min(room, row["effective_limit"]))
        return LoadNeed(weights or 0, kv_min, overhead)

    async def reserve(
        self, model: str, need: LoadNeed, ttl: float
    ) -> tuple[str | None, Shortfall | None]:
        """Ask the ledger for ``need``: the ticket when granted, else what is short.

        Raises:
            ValueError: The load can never fit (the message names the numbers), or the daemon
                has as many loads pending as it takes.
            VqpoolError: The daemon does not answer.
        """
        answer = await self.call(
            "load_reserve",
            model=model,
            weights=need.weights,
            overhead=need.overhead,
            kv_min=need.kv_min,
            ttl=min(MAX_TICKET_TTL, math.ceil(ttl)),
        )
        if answer["granted"]:
            return str(answer["ticket"]), None
        fields = ("short", "free", "weights", "overhead", "kv_min", "cached")
        return None, Shortfall(**{name: int(answer[name]) for name in fields})

    async def release(self, ticket: str) -> None:
        """Give a reservation back (its load failed or was given up)."""
        await self.call("load_release", ticket=ticket)

    async def budget(self) -> dict[str, Any]:
        """The ``budget`` op's answer (``budget``, ``total_held``, ``total_weights``,
        ``total_overhead``, ``free``, ...)."""
        answer: dict[str, Any] = await self.call("budget")
        return answer

    async def cache_released(self) -> None:
        """Wait (at most :data:`CACHE_RELEASE_WAIT` seconds) until the ledger's free bytes
        grow: the prompt caches the daemon just asked give their bytes back with their next
        heartbeat."""
        deadline = time.monotonic() + CACHE_RELEASE_WAIT
        free_before = (await self.budget())["free"]
        while time.monotonic() < deadline and free_before is not None:
            await asyncio.sleep(0.05)
            if (await self.budget())["free"] > free_before:
                return
