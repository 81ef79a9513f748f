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

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import speculative_generate_step
from vqpool.worker.kv.cache_source import CacheSource
from vqpool.worker.kv.quantized import KVQuantization
from vqpool.worker.sched.preemption import PreemptionPolicy
from vqpool.worker.sched.sampling import logits_processors, shared_sampler
from vqpool.worker.sched.sequential_batch import Round, SequentialBatch


def round_slots(job: Any) -> int:
    """The cache slots a job's next round may fill: its tokens so far (the last one is written
    in the round), the drafts, and one more (the draft model catching up on the model's token
    after a round whose drafts were all accepted writes it too)."""
    known = len(job.prompt) + len(job.generated)
    left = job.max_tokens - len(job.generated)
    return known + min(job.num_draft_tokens, left) + 1


class SpeculativeBatch(SequentialBatch):
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
        quantization: ``--kv-bits`` of stock caches (``--no-pool``): mlx-lm quantizes both
            models' caches (None: full precision).
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
        quantization: KVQuantization | None = None,
    ) -> None:
        super().__init__(
            model,
            source,
            eos_token_ids=eos_token_ids,
            prefill_step_size=prefill_step_size,
            preemption=preemption,
            quantization=quantization,
        )
        self.draft_model = draft_model

    def _rounds(self, job: Any, tokens: mx.array, max_tokens: int) -> Round:
        params = job.sampling
        return speculative_generate_step(
            tokens,
            self.model,
            self.draft_model,
            num_draft_tokens=job.num_draft_tokens,
            max_tokens=max_tokens,
            sampler=shared_sampler(params),
            logits_processors=logits_processors(params),
            prompt_cache=job.cache,
            prefill_step_size=self.prefill_step_size,
            kv_bits=self.kv_bits,
            kv_group_size=self.kv_group_size,
            quantized_kv_start=self.quantized_kv_start,
        )

    def round_slots(self, job: Any) -> int:
        return round_slots(job)
