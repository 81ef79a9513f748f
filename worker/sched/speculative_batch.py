"""Speculative decoding for the scheduler: a worker started with ``--draft-model`` runs each
request through mlx-lm's own ``speculative_generate_step``, one request at a time.

``mlx_lm.server`` does the same: a model loaded with a draft model is not batchable, so its
requests are served one after another with ``stream_generate(..., draft_model=...)``. mlx-lm's
batch classes have no draft model, and a draft round accepts a different number of tokens per
row, so rows of one batch would no longer share their cache lengths. The worker therefore
decodes with ``--max-concurrent 1`` when it has a draft model (the queue, admission, preemption
and the pool are the same).

:class:`SpeculativeBatch` has :class:`~vqpool.worker.sched.continuous_batch.ContinuousBatch`'s
interface (``start``, ``step``, ``leave``, ``row_kv``) so the scheduler drives it unchanged. A
step is one draft-and-verify round of the running request: its draft model proposes up to
``num_draft_tokens`` tokens, the model checks them in one forward pass, and the step reports
the accepted tokens and the model's own next token (the first step also prefills the prompt
into both models' caches). Before the round the request's cache is backed for the slots it may
write (``source.reserve``: the pool's blocks, which hold both models' KV, see
``worker/kv/draft_kv.py``); mlx-lm trims the slots of rejected draft tokens after it, and the
pooled cache gives blocks back once they are past what the tokens need. A request stops at an
EOS token (as ``stream_generate`` does) or ``max_tokens``; the rest of its round is dropped.

Sampling is ``mlx_lm.server``'s: its ``make_sampler`` and ``make_logits_processors`` for the
request, and ``mx.random.seed(seed)`` before a seeded request (the draft model samples with the
same sampler, from the same random stream, as in mlx-lm). At temperature 0 the tokens are those
the model alone gives. Generation-thread only.
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
from mlx_lm.generate import GenerationBatch, speculative_generate_step
from vqpool.shared.errors import BlockPoolExhaustedError
from vqpool.worker.kv.cache_source import CacheSource
from vqpool.worker.sched.continuous_batch import StepOutcome
from vqpool.worker.sched.preemption import PreemptionPolicy
from vqpool.worker.sched.sampling import logits_processors, shared_sampler

log = logging.getLogger("vqpool.worker")


def round_slots(job: Any) -> int:
    """The cache slots a job's next round may fill: its tokens so far (the last one is written
    in the round), the drafts, and one more (the draft model catching up on the model's token
    after a round whose drafts were all accepted writes it too)."""
    known = len(job.prompt) + len(job.generated)
    left = job.max_tokens - len(job.generated)
    return known + min(job.num_draft_tokens, left) + 1


_Round = Generator[tuple[mx.array, mx.array, bool], None, None]


@dataclass(eq=False)
class _Running:
    """The request being decoded: mlx-lm's generator over its cache, and its counts."""

    job: Any
    uid: int
    rounds: _Round
    max_tokens: int  # tokens it may make in this run
    made: int = 0


class SpeculativeBatch:
    """The started jobs of a scheduler with a draft model (module docstring).

    A job needs what :class:`~vqpool.worker.sched.continuous_batch.ContinuousBatch` needs, and
    ``num_draft_tokens`` (the request's, or the worker's ``--num-draft-tokens``).

    Args:
        model: The mlx-lm model.
        draft_model: The draft model (same vocabulary).
        source: Where caches come from; its ``reserve`` backs each round.
        eos_token_ids: Tokens that finish a job with "stop".
        prefill_step_size: Prompt tokens per prefill chunk (mlx-lm's ``prefill_step_size``).
        preemption: Who gives way when the pool refuses a growth.
    """

    def __init__(
        self,
        model: nn.Module,
        draft_model: nn.Module,
        source: CacheSource,
        *,
        eos_token_ids: frozenset[int],
        prefill_step_size: int,
        preemption: PreemptionPolicy | None = None,
    ) -> None:
        self.model = model
        self.draft_model = draft_model
        self.source = source
        self.eos_token_ids = eos_token_ids
        self.prefill_step_size = prefill_step_size
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
        none runs, and each round backs its own drafts (:func:`round_slots`)."""
        return True

    def row_kv(self, job: Any) -> tuple[list[Any], list[int]] | None:
        """None: no prompt cache keeps a draft model's KV."""
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
        """One draft-and-verify round of the running job (the next one starts if none runs)."""
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
            log.exception("request %s failed in a speculative round", running.job.owner)
            self.leave(running.job)
            outcome.failed.append((running.job, exc))
        return outcome

    def _begin(self, job: Any) -> _Running:
        tokens = [*job.prompt, *job.generated]
        params = job.sampling
        if params.seed is not None:
            mx.random.seed(params.seed)
        max_tokens = job.max_tokens - len(job.generated)
        rounds = speculative_generate_step(
            mx.array(tokens, mx.uint32),
            self.model,
            self.draft_model,
            num_draft_tokens=job.num_draft_tokens,
            max_tokens=max_tokens,
            sampler=shared_sampler(params),
            logits_processors=logits_processors(params),
            prompt_cache=job.cache,
            prefill_step_size=self.prefill_step_size,
        )
        self._next_uid += 1
        return _Running(job, self._next_uid, rounds, max_tokens)

    def _back_round(self, running: _Running, outcome: StepOutcome) -> bool:
        """Back the slots the next round may write (:func:`round_slots`). False when the job
        gave way."""
        job = running.job
        while True:
            try:
                self.source.reserve(job.cache, round_slots(job))
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
