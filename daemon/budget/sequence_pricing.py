"""What ``fit`` prices one sequence of a model with: its bytes per block in full precision and,
for a model whose worker quantizes KV, in its quantized format, with how the worker holds a
sequence's blocks (:func:`vqpool.shared.kv_sequence.sequence_bytes` counts them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vqpool.daemon.budget.ledger import bytes_for_context
from vqpool.shared.kv_sequence import SequenceQuantization, sequence_bytes


@dataclass(frozen=True)
class SequencePricing:
    """Bytes per block of each stream (``"all"``: one total, for a model not loaded) in full
    precision, and in the quantized ``format`` its worker converts to (None: it keeps full
    precision) with that worker's ``quantization``."""

    bytes_per_block: Mapping[str, int]
    quantized: Mapping[str, int] | None = None
    format: str | None = None
    quantization: SequenceQuantization | None = None

    def per_sequence(self, context: int, block_size: int, streams: Sequence[str]) -> int:
        """Bytes one sequence of ``context`` tokens needs at its smallest.

        Raises:
            ValueError: A stream with no bytes per block, or a count below 1.
        """
        names = ["all"] if "all" in self.bytes_per_block else list(streams)
        fp = bytes_for_context(1, block_size, self.bytes_per_block, names)  # one block
        quantized = None
        if self.quantized is not None:
            quantized = bytes_for_context(1, block_size, self.quantized, names)
        return sequence_bytes(context, block_size, fp, quantized, self.quantization)
