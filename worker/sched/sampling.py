"""How a job picks its tokens: its sampling parameters, and the sampler and logits processors
of its row in the batch, made from mlx-lm's own (``make_sampler``, ``make_logits_processors``).

A job with a ``seed`` gets a sampler of its own holding its own PRNG key (:class:`SeededSampler`):
``mx.random.seed`` (what ``mlx_lm.server`` does with ``seed``) sets one global state that every
row of a batch draws from, so a row's tokens would depend on what else runs.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    apply_xtc,
    make_logits_processors,
    make_sampler,
)

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass(frozen=True)
class SamplingParams:
    """How a job picks its tokens: mlx-lm's ``make_sampler`` and ``make_logits_processors``
    arguments (temperature 0 = greedy; a penalty of 0 is off), and a ``seed`` for the job's own
    random stream. Hashable: jobs with equal parameters and no seed share one sampler."""

    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 0.0
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    presence_context_size: int = 20
    frequency_penalty: float = 0.0
    frequency_context_size: int = 20
    logit_bias: tuple[tuple[int, float], ...] = ()
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    xtc_special_tokens: tuple[int, ...] = ()
    """Tokens XTC never removes (``mlx_lm.server``: the newline and the EOS tokens)."""
    seed: int | None = None

    def sampler_key(self) -> Hashable:
        """What the sampler depends on (the logits processors are per row anyway)."""
        return (
            self.temperature,
            self.top_p,
            self.top_k,
            self.min_p,
            self.xtc_probability,
            self.xtc_threshold,
            self.xtc_special_tokens,
        )


def logits_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """The row's logits processors, as ``mlx_lm.server`` makes them."""
    return make_logits_processors(
        dict(params.logit_bias) or None,
        params.repetition_penalty,
        params.repetition_context_size,
        params.presence_penalty,
        params.presence_context_size,
        params.frequency_penalty,
        params.frequency_context_size,
    )


def shared_sampler(params: SamplingParams) -> Sampler:
    """The sampler of unseeded rows with these parameters, as ``mlx_lm.server`` makes it."""
    return make_sampler(
        params.temperature,
        top_p=params.top_p,
        min_p=params.min_p,
        top_k=params.top_k,
        xtc_probability=params.xtc_probability,
        xtc_threshold=params.xtc_threshold,
        xtc_special_tokens=list(params.xtc_special_tokens),
    )


class SeededSampler:
    """``make_sampler``'s chain for one row, drawing from the row's own key.

    The keys are those ``mx.random.seed(seed)`` gives the global stream (each draw splits the
    key and uses the second half), so a job alone samples what ``generate_step`` samples after
    ``mx.random.seed(seed)``; in a batch it samples the same, since no other row draws from its
    key. ``draws`` is the number of draws made before the first call: a job resumed after
    ``n`` tokens starts at the draws those tokens took, so preemption does not change its text.
    """

    def __init__(self, params: SamplingParams, *, tokens_done: int = 0) -> None:
        self.params = params
        self._draws_per_token = 2 if params.xtc_probability > 0.0 else 1
        self._key = mx.random.key(params.seed or 0)
        for _ in range(tokens_done * self._draws_per_token):
            self._next_key()

    def _next_key(self) -> mx.array:
        self._key, subkey = mx.random.split(self._key)
        return subkey

    def __call__(self, logprobs: mx.array) -> mx.array:
        p = self.params
        if 0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        if p.min_p != 0.0:
            logprobs = apply_min_p(logprobs, p.min_p)
        if p.xtc_probability > 0.0:
            # mlx-lm's XTC mask, always applied, kept with the row's own draw (apply_xtc draws
            # from the global stream).
            masked = apply_xtc(logprobs, 1.0, p.xtc_threshold, list(p.xtc_special_tokens))
            keep = mx.random.uniform(0, 1, key=self._next_key()) > p.xtc_probability
            logprobs = mx.where(keep, logprobs, masked)
        if p.top_k > 0:
            logprobs = apply_top_k(logprobs, p.top_k)
        return mx.random.categorical(logprobs * (1.0 / p.temperature), key=self._next_key())


def row_sampler(
    params: SamplingParams, shared: dict[Hashable, Sampler], *, tokens_done: int = 0
) -> Sampler:
    """The sampler of a row: its own for a seeded job that samples (temperature above 0), else
    the one ``shared`` holds for its parameters (rows sharing a sampler sample in one call).
    ``tokens_done``: tokens the job generated before (a resumed job)."""
    if params.seed is not None and params.temperature > 0:
        return SeededSampler(params, tokens_done=tokens_done)
    key = params.sampler_key()
    sampler = shared.get(key)
    if sampler is None:
        sampler = shared[key] = shared_sampler(params)
    return sampler
