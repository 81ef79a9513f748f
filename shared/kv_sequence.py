"""The bytes one sequence of N tokens needs at its smallest: what the worker's admission and
conversion of a quantizing request hold at their peak, and so what the daemon's ``fit``, the
worker's never-fits check, ``vqpoolctl fit`` of a model not loaded and the front door's load
minimum price it at. One function, so that they all agree.

mlx-lm's ``maybe_quantize_kv_cache`` quantizes a cache once it holds ``quantized_kv_start``
tokens after a forward pass (``vqpool-worker --quantized-kv-start``):

- a sequence of fewer tokens stays in full precision;
- with start 0 every pass but the first reads quantized KV, and the worker's admission takes
  full-precision blocks for the first pass only (at most one prefill chunk: the *first-pass
  slots*) beside quantized ones for the rest, in one pool call; so a sequence of N tokens
  holds its first-pass blocks in full precision and the rest quantized, at once;
- with start T > 0 the sequence holds full-precision blocks for at least T tokens before it is
  quantized, then quantized blocks for all N (the full-precision ones go back before the
  quantized ones are taken): it needs the larger of the two. That is its smallest: a prompt
  longer than T is admitted with full-precision blocks for all of it (its admission reserves
  them before its first pass), which the fit of N tokens, knowing no prompt, cannot count.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFILL_STEP_SIZE = 2048
"""Prompt tokens one prefill chunk processes (mlx-lm's ``prefill_step_size`` default;
``vqpool-worker --prefill-step-size``)."""


@dataclass(frozen=True)
class SequenceQuantization:
    """How a quantizing worker holds a sequence's blocks: ``start`` (``--quantized-kv-start``)
    and ``first_pass_slots`` (the most full-precision slots its admission takes beside quantized
    ones: one prefill chunk with start 0, else 0).

    Raises:
        ValueError: A negative count, or first-pass slots with a start above 0.
    """

    start: int = 0
    first_pass_slots: int = 0

    def __post_init__(self) -> None:
        if self.start < 0 or self.first_pass_slots < 0:
            raise ValueError(
                f"quantized KV start and first-pass slots must be >= 0, got {self.start} and "
                f"{self.first_pass_slots}"
            )
        if self.start and self.first_pass_slots:
            raise ValueError("first-pass slots are held only with a quantized KV start of 0")

    @classmethod
    def of(cls, start: int, prefill_step_size: int) -> SequenceQuantization:
        """A worker's, from ``--quantized-kv-start`` and ``--prefill-step-size``."""
        return cls(start, prefill_step_size if start == 0 else 0)


def sequence_bytes(
    n_tokens: int,
    block_size: int,
    fp_block_bytes: int,
    quantized_block_bytes: int | None = None,
    quantization: SequenceQuantization | None = None,
) -> int:
    """Bytes of blocks (every stream) one sequence of ``n_tokens`` tokens needs at its
    smallest: its peak, as the module docstring says. ``fp_block_bytes``: one block in full
    precision; ``quantized_block_bytes``: one block quantized (None, or no ``quantization``:
    the model keeps full precision).

    Raises:
        ValueError: ``n_tokens`` or ``block_size`` below 1.
    """
    if n_tokens < 1 or block_size < 1:
        raise ValueError(f"tokens and block size must be >= 1, got {n_tokens} and {block_size}")
    n_blocks = -(-n_tokens // block_size)
    if quantized_block_bytes is None or quantization is None or n_tokens < quantization.start:
        return n_blocks * fp_block_bytes
    if quantization.start:
        before = -(-quantization.start // block_size) * fp_block_bytes
        return max(before, n_blocks * quantized_block_bytes)
    n_first = -(-min(n_tokens, quantization.first_pass_slots) // block_size)
    return n_first * fp_block_bytes + (n_blocks - n_first) * quantized_block_bytes
