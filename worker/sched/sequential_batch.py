"""Requests served one at a time through mlx-lm's own generator over each request's cache, behind
:class:`~vqpool.worker.sched.continuous_batch.ContinuousBatch`'s interface (``start``, ``step``,
``leave``, ``row_kv``), so the scheduler drives it unchanged: what ``mlx_lm.server`` does with a
request it cannot batch (``stream_generate`` one request after another).

:class:`SequentialBatch` serves stock mlx-lm caches quantized with ``--kv-bits`` (``--no-pool``):
``generate_step(..., kv_bits=...)`` makes mlx-lm's ``QuantizedKVCache`` of the request's cache as
``mlx_lm.server --kv-bits`` does, which mlx-lm's batch classes do not take (``mlx_lm.server``
turns batching off with ``--kv-bits`` too). A step is one round of the running request: one
token here, the accepted drafts and the model's token for
:class:`~vqpool.worker.sched.speculative_batch.SpeculativeBatch`. Before the round the request's
cache is backed for the slots it may write (``source.reserve``; stock caches grow on their own).
A request stops at an EOS token (as ``stream_generate`` does) or ``max_tokens``.

Sampling is ``mlx_lm.server``'s: its ``make_sampler`` and ``make_logits_processors`` for the
request, and ``mx.random.seed(seed)`` before a seeded request. Generation-thread only.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationBatch, generate_step
from vqpool.shared.errors import BlockPoolExhaustedError
from vqpool.shared.kv_formats import DEFAULT_GROUP_SIZE
from vqpool.worker.kv.cache_source import CacheSource
from vqpool.worker.kv.quantized import KVQuantization
from vqpool.worker.sched.continuous_batch import StepOutcome
from vqpool.worker.sched.preemption import PreemptionPolicy
from vqpool.worker.sched.sampling import logits_processors, shared_sampler

log = logging.getLogger("vqpool.worker")

Round = Generator[tuple[Any, mx.array, bool], None, None]
"""mlx-lm's tokens of a request: (token, logprobs, whether a draft model proposed it)."""


@dataclass(eq=False)
class _Running:
    """The request being decoded: mlx-lm's generator over its cache, and its counts."""

    job: Any
    uid: int
    rounds: Round
    max_tokens: int  # tokens it may make in this run
    made: int = 0


class SequentialBatch:
    """The started jobs of a scheduler that decodes one at a time (module docstring).

    A job needs what :class:`~vqpool.worker.sched.continuous_batch.ContinuousBatch` needs.

    Args:
        model: The mlx-lm model.
        source: Where caches come from; its ``reserve`` backs each round.
        eos_token_ids: Tokens that finish a job with "stop".
        prefill_step_size: Prompt tokens per prefill chunk (mlx-lm's ``prefill_step_size``).
        preemption: Who gives way when the pool refuses a growth.
        quantization: ``--kv-bits`` of stock caches (``--no-pool``): mlx-lm quantizes each
            request's cache (None: full precision).
    """

    def __init__(
        self,
        model: nn.Module,
        source: CacheSource,
        *,
        eos_token_ids: frozenset[int],
        prefill_step_size: int,
        preemption: PreemptionPolicy | None = None,
        quantization: KVQuantization | None = None,
    ) -> None:
        self.model = model
        self.source = source
        self.eos_token_ids = eos_token_ids
        self.prefill_step_size = prefill_step_size
        kv = quantization
        self.kv_bits = None if kv is None else kv.bits
        """mlx-lm's ``kv_bits``, ``kv_group_size`` and ``quantized_kv_start`` of
        ``quantization`` (``kv_bits`` None: never quantized)."""
        self.kv_group_size = DEFAULT_GROUP_SIZE if kv is None else kv.group_size
        self.quantized_kv_start = 0 if kv is None else kv.start
        self.preemption = preemption or PreemptionPolicy(source.fits_alone)
        self._waiting: deque[Any] = deque()
        self._running: _Running | None = None
        self._next_uid = 0

    def start(self, job: Any) -> None:
        """Queue ``job`` (its cache backed for its prompt); it runs once the one before ends."""
        self._waiting.append(job)

    def in_batch(self, job: Any) -> bool:
        """Whether ``job`` is the one decoding now."""
        return self._running is not None and self._running.job is job

    def used_slots(self) -> int:
        """0: a job never joins another's rows here, so no admission pads to them."""
        return 0

    def back_ahead(self, n_slots: int) -> bool:
        """True: jobs run one at a time (``max_concurrent`` 1), so a job is admitted only when
        none runs, and each round backs its own slots (:meth:`round_slots`)."""
        return True

    def row_kv(self, job: Any) -> tuple[list[Any], list[int]] | None:
        """None: no prompt cache keeps these caches (a draft model's KV, stock caches)."""
        return None

    def leave(self, job: Any) -> None:
        """Take ``job`` out: its round ends (mlx-lm trims the draft's slots) and it is dropped."""
        running = self._running
        if running is not None and running.job is job:
            self._running = None
            with contextlib.suppress(Exception):
                running.rounds.close()
            return
        if job in self._waiting:
            self._waiting.remove(job)

    def step(self) -> StepOutcome:
        """One round of the running job (the next one starts if none runs)."""
        outcome = StepOutcome()
        if self._running is None:
            if not self._waiting:
                return outcome
            job = self._waiting.popleft()
            try:
                self._running = self._begin(job)
            except Exception as exc:
                log.exception("request %s failed to start", job.owner)
                outcome.failed.append((job, exc))
                return outcome
        running = self._running
        if not self._back_round(running, outcome):
            return outcome
        try:
            self._round(running, outcome)
        except BlockPoolExhaustedError:
            # A write past what the round was backed for: its cache is dropped either way.
            self._give_way(running.job, outcome)
        except Exception as exc:
            log.exception("request %s failed in its round", running.job.owner)
            self.leave(running.job)
            outcome.failed.append((running.job, exc))
        return outcome

    def _begin(self, job: Any) -> _Running:
        tokens = [*job.prompt, *job.generated]
        params = job.sampling
        if params.seed is not None:
            mx.random.seed(params.seed)
        max_tokens = job.max_tokens - len(job.generated)
        rounds = self._rounds(job, mx.array(tokens, mx.uint32), max_tokens)
        self._next_uid += 1
        return _Running(job, self._next_uid, rounds, max_tokens)

    def _rounds(self, job: Any, tokens: mx.array, max_tokens: int) -> Round:
        """mlx-lm's ``generate_step`` over the job's cache, with the worker's ``--kv-bits``
        (``maybe_quantize_kv_cache`` quantizes the cache as in ``stream_generate``): each
        token a round of its own."""
        params = job.sampling
        steps = generate_step(
            tokens,
            self.model,
            max_tokens=max_tokens,
            sampler=shared_sampler(params),
            logits_processors=logits_processors(params),
            prompt_cache=job.cache,
            prefill_step_size=self.prefill_step_size,
            kv_bits=self.kv_bits,
            kv_group_size=self.kv_group_size,
            quantized_kv_start=self.quantized_kv_start,
        )
        return ((token, logprobs, False) for token, logprobs in steps)

    def round_slots(self, job: Any) -> int:
        """The cache slots a job's next round may fill: its tokens so far and the one it
        makes."""
        return len(job.prompt) + len(job.generated) + 1

    def _back_round(self, running: _Running, outcome: StepOutcome) -> bool:
        """Back the slots the next round may write (:meth:`round_slots`). False when the job
        gave way."""
        job = running.job
        while True:
            try:
                self.source.reserve(job.cache, self.round_slots(job))
                return True
            except BlockPoolExhaustedError:
                if self._give_way(job, outcome):
                    return False

    def _give_way(self, job: Any, outcome: StepOutcome) -> bool:
        """The pool refused ``job``'s growth: the preemption policy's victim leaves (a job that
        is alone is evicted: the scheduler preempts or ends it). True when ``job`` left."""
        started = [job, *self._waiting]
        victim = self.preemption.growth_victim(started)
        if victim is None:
            self.leave(job)
            outcome.evicted.append(job)
            return True
        self.leave(victim)
        outcome.preempted.append(victim)
        return victim is job

    def _round(self, running: _Running, outcome: StepOutcome) -> None:
        """Pull one round's tokens from mlx-lm's generator: the accepted drafts, then the
        model's own token."""
        job = running.job
        while True:
            raw, logprobs, from_draft = next(running.rounds)
            running.made += 1
            token = int(raw)  # a Python int from mlx-lm (its annotation says array)
            outcome.tokens.append((job, token, logprobs))
            outcome.drafted += from_draft
            reason = (
                "stop"
                if token in self.eos_token_ids
                else "length"
                if running.made >= running.max_tokens
                else None
            )
            if reason is not None:
                self.leave(job)
                response = GenerationBatch.Response(
                    running.uid, token, logprobs, reason, None, None
                )
                outcome.finished.append((job, reason, response))
                return
            if not from_draft:
                return
