"""Continuous batching for the scheduler: the started jobs of one worker, prefilled in chunks and
decoded together in one batched forward pass per step.

Built on mlx-lm's own batch classes (the ones its ``BatchGenerator`` and ``mlx_lm.server`` use):
``PromptProcessingBatch`` prefills a job, ``GenerationBatch`` decodes the batch (left-padded
rows, mlx-lm's pipelining: step n+1 is built before step n's tokens are read). So greedy tokens
are those of mlx-lm's ``batch_generate`` with stock caches, and at batch 1 those of
``generate_step``. :class:`ContinuousBatch` adds what a server around them needs:

* **Chunked prefill, one job at a time.** :meth:`ContinuousBatch.step` decodes the batch once,
  then prefills one chunk (at most ``prefill_step_size`` tokens) of the oldest started job; its
  last chunk goes with its last prompt token, which makes its first token, and it joins the
  batch in that step. A newcomer delays the running jobs by at most one chunk.
* **Blocks before every forward pass.** Before each pass ``source.grow`` makes the cache it
  writes cover the slots it writes (the pool's blocks for every row, padding included). When
  the pool cannot grow a row, the started job (in the batch or in its prefill) that the
  preemption policy names gives way (:meth:`PreemptionPolicy.growth_victim
  <vqpool.worker.sched.preemption.PreemptionPolicy.growth_victim>`: the cheapest to recompute
  that is not about to finish): ``on_preempt`` sees its row first (the scheduler keeps its
  prompt's KV for the prompt cache), then it is taken out and reported as preempted (its
  blocks are back), and growth is tried again; a row the pool cannot grow while its job is the
  only one started is taken out and reported as evicted. Joining grows both sides first, the
  same way (the newcomer, with little computed yet, is usually the one that gives way).
* **Growing ahead** (:meth:`ContinuousBatch.back_ahead`): before the scheduler starts another
  request beside the batch's rows, it has their next slots backed
  (:mod:`vqpool.worker.sched.growth_forecast`); a refusal preempts nobody. With ``look_ahead``,
  a decode step whose next slot crosses the rows' blocks first asks for that many slots ahead
  from free memory (one pool call per row for several blocks instead of one per block: each
  is a round trip to the daemon on the generation thread); refused, it grows by one slot as
  before, and asks ahead again only once the batch reached the slots it asked for or a row left
  (asked at every block meanwhile, it would be refused the same way, a round trip each).
* **Resuming.** A preempted job starts again like a new one, its generated tokens (``job.
  generated``) appended to its prompt: all but the last are prefilled, the last is the next
  input, and it may make ``max_tokens - len(generated)`` more tokens. With a quantizing source
  (``--kv-bits``) a chunk ends where the prompt's prefill ended: the prompt is computed as its
  first start computed it (its first pass in full precision, then quantized), and its
  generated tokens' KV as decoding them did (quantized attention).
* **Leaving** (:meth:`ContinuousBatch.leave`) takes a job's row out of the batch, or the job out
  of the prefill queue: its cache's blocks go back at once (a pooled batch releases a row it
  drops).

The step reports what happened (:class:`StepOutcome`); the scheduler sends the tokens and ends
the jobs. Generation-thread only.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import (
    GenerationBatch,
    PromptProcessingBatch,
    StopSequences,
    greedy_sampler,
)
from vqpool.worker.kv.batch_cache import batch_of
from vqpool.worker.kv.cache_source import CacheSource
from vqpool.worker.sched.preemption import PreemptionPolicy
from vqpool.worker.sched.sampling import Sampler, logits_processors, row_sampler

log = logging.getLogger("vqpool.worker")


@dataclass
class StepOutcome:
    """What one :meth:`ContinuousBatch.step` did, in the order the scheduler must act on it.

    Attributes:
        evicted: Jobs taken out because the pool could not back their next forward pass
            with no other started job to preempt.
        preempted: Jobs taken out (blocks back) so that others' next forward pass could be
            backed; the scheduler requeues them.
        failed: Jobs taken out because their forward pass raised, with the error.
        tokens: ``(job, token, logprobs)`` per job that got a token this step.
        finished: ``(job, "stop" | "length", response)`` per job that reached EOS or
            ``max_tokens`` with its token above; its row is out of the batch already. The
            seam for a prompt cache: ``response.prompt_cache`` holds the row's KV (stock
            ``KVCache`` copies holding no blocks) and ``response.all_tokens`` its token ids.
        drafted: Tokens of ``tokens`` a draft model proposed and the model accepted
            (speculative decoding only).
        decoded_rows: Rows of the decode step (0 when none ran).
        held_slots: Slots its buffers held: rows x the batch's length, left padding included.
        token_slots: Of those, the slots the rows' own tokens fill.
        grow_seconds: Seconds its pool calls to grow caches took (waits at the daemon
            included).
        prefill_seconds: Seconds its prefill chunk took (its growth included).
    """

    evicted: list[Any] = field(default_factory=list)
    preempted: list[Any] = field(default_factory=list)
    failed: list[tuple[Any, Exception]] = field(default_factory=list)
    tokens: list[tuple[Any, int, mx.array]] = field(default_factory=list)
    finished: list[tuple[Any, str, GenerationBatch.Response]] = field(default_factory=list)
    drafted: int = 0
    decoded_rows: int = 0
    held_slots: int = 0
    token_slots: int = 0
    grow_seconds: float = 0.0
    prefill_seconds: float = 0.0


@dataclass(eq=False)
class _Prefill:
    """A started job waiting for, or in, its prefill."""

    job: Any
    uid: int
    cached: list[int] = field(default_factory=list)  # prompt tokens its cache holds already
    to_prefill: list[int] = field(default_factory=list)
    batch: PromptProcessingBatch | None = None


class ContinuousBatch:
    """The started jobs of a scheduler (see the module docstring).

    A job needs ``prompt`` (token ids), ``generated`` (the token ids it made before it was
    preempted, if it was), ``admission`` (its first admission's rank: the highest gives way
    first), ``max_tokens``, ``sampling`` (a ``SamplingParams``: the row's sampler and logits
    processors, which see the row's prompt and generated tokens as ``generate_step``'s do, a
    resumed or prompt-cached row's included), ``cache`` (made by ``source.open`` and backed
    for its prompt: the seam where a prompt cache would hand a cache holding a cached prefix)
    and ``owner``.

    Args:
        model: The mlx-lm model.
        source: Where caches come from; its ``grow`` backs each forward pass.
        eos_token_ids: Tokens that finish a job with "stop".
        prefill_step_size: Prompt tokens per prefill chunk.
        on_prefill_start: Called with a job and the tokens its cache is to hold when its
            prefill begins, before its cache is read: a prompt cache copies a cached prefix of
            them into the job's cache there (and may first store the prompts of rows in the
            batch that share a prefix with them, :meth:`row_kv`).
        preemption: Who gives way when the pool refuses a growth (the scheduler's policy;
            None: one of its own over ``source``).
        on_preempt: Called with a job about to give way to a refused growth while its row is
            still in the batch (:meth:`row_kv` is valid).
        look_ahead: Slots a decode step's growth asks for ahead of its next slot (None or 0:
            none).
    """

    def __init__(
        self,
        model: nn.Module,
        source: CacheSource,
        *,
        eos_token_ids: frozenset[int],
        prefill_step_size: int,
        on_prefill_start: Callable[[Any, list[int]], None] | None = None,
        preemption: PreemptionPolicy | None = None,
        on_preempt: Callable[[Any], None] | None = None,
        look_ahead: Callable[[], int] | None = None,
    ) -> None:
        self.model = model
        self.on_preempt = on_preempt
        self.look_ahead = look_ahead
        self.preemption = preemption or PreemptionPolicy(source.fits_alone)
        self.on_prefill_start = on_prefill_start
        self.source = source
        self.prefill_step_size = prefill_step_size
        self._stop_tokens = StopSequences([[t] for t in sorted(eos_token_ids)] or None)
        self._samplers: dict[Hashable, Sampler] = {}  # unseeded rows' samplers, shared
        self._generation = GenerationBatch.empty(model, greedy_sampler)
        self._prefilling: deque[_Prefill] = deque()
        self._by_uid: dict[int, Any] = {}  # the jobs of the batch's rows
        self._next_uid = 0
        self._grow_deadline: float | None = None  # until when this step's growths may wait
        # A refused look-ahead is not asked again before the batch reaches the slots it asked
        # for, or a row leaves (a pool call each, refused the same way while nothing is freed).
        self._no_ahead_until = 0

    def start(self, job: Any) -> None:
        """Queue ``job`` (its cache backed for its prompt) for its prefill. A cache that holds
        tokens when the prefill begins (a cached prefix of its tokens, at most all but the last)
        is prefilled with the rest only. A resumed job's tokens are its prompt and generated
        tokens."""
        self._prefilling.append(_Prefill(job, self._next_uid))
        self._next_uid += 1

    def _begin_prefill(self, pending: _Prefill) -> None:
        """Split the job's tokens into what its cache holds and what is left to prefill.

        Raises:
            ValueError: The cache holds as many tokens as the prompt, or more.
        """
        job = pending.job
        tokens = _tokens_of(job)
        if self.on_prefill_start is not None:
            self.on_prefill_start(job, tokens)
        cached = job.cache[0].size()
        if cached >= len(tokens):
            raise ValueError(
                f"the cache holds {cached} tokens of a {len(tokens)}-token prompt; it may "
                "hold all but the prompt's last token at most"
            )
        pending.cached = list(tokens[:cached])
        pending.to_prefill = list(tokens[cached:-1])

    def row_kv(self, job: Any) -> tuple[list[Any], list[int]] | None:
        """A copy of the KV of ``job``'s row in the batch (one stock ``KVCache`` per layer)
        and the token ids it covers; None when the job has no row in the batch."""
        batch = self._generation
        for i, uid in enumerate(batch.uids):
            if self._by_uid[uid] is job:
                return batch.extract_cache(i), list(batch.tokens[i])
        return None

    def in_batch(self, job: Any) -> bool:
        """Whether ``job`` has a row in the batch (it is prefilled and decoding)."""
        return any(other is job for other in self._by_uid.values())

    def used_slots(self) -> int:
        """Slots the batch's rows use now (padding included; 0 with no row)."""
        batch = self._generation
        return batch.prompt_cache[0].size() if len(batch) else 0

    def back_ahead(self, n_slots: int) -> bool:
        """Have every row of the batch backed for ``n_slots`` slots, from free memory only
        (without waiting, taking the prompt cache's memory or preempting anyone); False when
        the pool refused a row (rows that got blocks keep them: they grow into them). True
        with an empty batch."""
        batch = self._generation
        if not len(batch):
            return True
        try:
            failed = self.source.grow(batch.prompt_cache, n_slots, reclaim=False)
        except Exception as exc:
            log.warning("backing the batch's next growth failed: %s", exc)
            return False
        return not failed

    def leave(self, job: Any) -> None:
        """Take ``job`` out of the batch or the prefill queue, if it is there. Before the
        filter, the batch's ``extract_cache`` and ``tokens`` of its row are still valid (for a
        prompt cache keeping what a cancelled request computed)."""
        batch = self._generation
        for i, uid in enumerate(batch.uids):
            if self._by_uid[uid] is job:
                del self._by_uid[uid]
                batch.filter([k for k in range(len(batch.uids)) if k != i])
                self._no_ahead_until = 0
                return
        for pending in self._prefilling:
            if pending.job is job:
                self._prefilling.remove(pending)
                if pending.batch is not None:
                    pending.batch.filter([])
                return

    def step(self) -> StepOutcome:
        """One decode step of the batch, then one prefill chunk (module docstring)."""
        outcome = StepOutcome()
        # The step's growths share one deadline: the step blocks at most this long waiting
        # for bytes at the daemon (plus round trips), however many rows and calls grow.
        wait = self.source.growth_wait
        self._grow_deadline = time.monotonic() + wait if wait > 0 else None
        self._decode(outcome)
        started = time.perf_counter()
        self._prefill_chunk(outcome)
        outcome.prefill_seconds = time.perf_counter() - started
        return outcome

    def _decode(self, outcome: StepOutcome) -> None:
        batch = self._generation
        if not len(batch):
            return
        # The step writes the batch's next slot: back it before the forward pass.
        ahead = self.look_ahead() if self.look_ahead is not None else 0
        if ahead > 0:
            next_slot = batch.prompt_cache[0].size() + 1
            pooled = batch_of(batch.prompt_cache)
            due = next_slot >= self._no_ahead_until
            if pooled is not None and pooled.length < next_slot and due:
                started = time.perf_counter()
                if not self.back_ahead(next_slot + ahead):
                    self._no_ahead_until = next_slot + ahead
                outcome.grow_seconds += time.perf_counter() - started
        if not self._grow(
            lambda: batch.prompt_cache, lambda: batch.prompt_cache[0].size() + 1, outcome
        ):
            return
        rows = [self._by_uid[uid] for uid in batch.uids]
        outcome.decoded_rows = len(rows)
        outcome.held_slots = len(rows) * (batch.prompt_cache[0].size() + 1)
        outcome.token_slots = sum(len(job.prompt) + len(job.generated) for job in rows)
        try:
            responses = batch.next()
        except Exception as exc:
            log.exception("a batched step failed")
            for uid in list(batch.uids):
                job = self._by_uid[uid]
                self.leave(job)
                outcome.failed.append((job, exc))
            return
        for response in responses:
            job = self._by_uid[response.uid]
            outcome.tokens.append((job, int(response.token), response.logprobs))
            if response.finish_reason is not None:
                # GenerationBatch took the row out (a pooled batch gave its blocks back).
                del self._by_uid[response.uid]
                self._no_ahead_until = 0
                reason = "stop" if response.finish_reason == "stop" else "length"
                outcome.finished.append((job, reason, response))

    def _prefill_chunk(self, outcome: StepOutcome) -> None:
        if not self._prefilling:
            return
        pending = self._prefilling[0]
        job = pending.job
        try:
            if pending.batch is None:
                self._begin_prefill(pending)
                # The batch feeds a row's processors the tokens its cache holds (``tokens``
                # below: a cached prefix, then what is prefilled) and each token it decodes:
                # the prompt and generated tokens, as generate_step's.
                sampler = row_sampler(job.sampling, self._samplers, tokens_done=len(job.generated))
                pending.batch = PromptProcessingBatch(
                    self.model,
                    uids=[pending.uid],
                    caches=[job.cache],
                    tokens=[pending.cached],
                    prefill_step_size=self.prefill_step_size,
                    samplers=[sampler],
                    fallback_sampler=greedy_sampler,
                    logits_processors=[logits_processors(job.sampling)],
                    stop_sequences=[self._stop_tokens],
                    max_tokens=[job.max_tokens - len(job.generated)],
                )
            prompt_batch = pending.batch
            used = prompt_batch.prompt_cache[0].size()
            cache = prompt_batch.prompt_cache
            n_chunk = self._chunk_length(job, used)
            if len(pending.to_prefill) > n_chunk:
                chunk = pending.to_prefill[:n_chunk]
                if self._grow(lambda: cache, lambda: used + len(chunk), outcome, job):
                    prompt_batch.prompt([chunk])
                    del pending.to_prefill[: len(chunk)]
                return
            # The last chunk and the last prompt token in one go: the job joins in this step
            # rather than after one more decode step of the batch (a burst of n newcomers
            # would cost the running rows n extra steps at small batch sizes).
            rest = [*pending.to_prefill, _tokens_of(job)[-1]]
            if not self._grow(lambda: cache, lambda: used + len(rest), outcome, job):
                return
            newcomer = prompt_batch.generate([rest])
        except Exception as exc:
            log.exception("request %s failed in its prefill", job.owner)
            self.leave(job)
            outcome.failed.append((job, exc))
            return
        self._prefilling.popleft()
        self._join(job, pending.uid, newcomer, outcome)

    def _chunk_length(self, job: Any, used: int) -> int:
        """Tokens the job's next prefill chunk may take, its cache holding ``used``: at most
        ``prefill_step_size``, and for a resumed job of a quantizing source, up to the end of
        its prompt's prefill (module docstring)."""
        n_chunk = self.prefill_step_size
        if job.generated and getattr(self.source, "quantized", None) is not None:
            prompt_end = len(job.prompt) - 1 - used
            if 0 < prompt_end < n_chunk:
                n_chunk = prompt_end
        return n_chunk

    def _join(self, job: Any, uid: int, newcomer: GenerationBatch, outcome: StepOutcome) -> None:
        """Add the prefilled ``job`` (alone in ``newcomer``) to the batch: the rows of both
        are grown first to the joined batch's next step. When the running rows cannot grow to
        the newcomer's length (its prompt would pad them), the most recently admitted job,
        usually the newcomer, gives way."""
        batch = self._generation
        if len(batch):

            def n_slots() -> int:
                # Growing the newcomer may preempt the last running row: the batch is empty then.
                running = batch.prompt_cache[0].size() if batch.prompt_cache else 0
                return max(running, newcomer.prompt_cache[0].size()) + 1

            backed = self._grow(lambda: batch.prompt_cache, n_slots, outcome, joining=job)
            gave_way = [*outcome.preempted, *outcome.evicted, *(j for j, _ in outcome.failed)]
            if job in gave_way:
                return
            # Not backed: every running row gave way, and the newcomer starts the batch anew.
            if backed and not self._grow(lambda: newcomer.prompt_cache, n_slots, outcome, job):
                return
        self._by_uid[uid] = job
        batch.extend(newcomer)

    def _started(self) -> list[Any]:
        """Every started job: the batch's rows and the jobs waiting for or in their prefill."""
        return [*self._by_uid.values(), *(p.job for p in self._prefilling)]

    def _grow(
        self,
        cache: Callable[[], list[Any]],
        n_slots: Callable[[], int],
        outcome: StepOutcome,
        prefilling: Any = None,
        *,
        joining: Any = None,
    ) -> bool:
        """Make ``cache()`` (the batch's, or the cache of the job ``prefilling``) cover
        ``n_slots()`` slots. While the pool cannot grow a row, the most recently admitted
        started job gives way (``outcome.preempted``; both are asked again after, as the batch
        may have shrunk); a row whose job is the only one started is evicted. False when the
        cache has no row left (``prefilling`` or ``joining`` gave way, or the batch is empty).
        Who gives way is the preemption policy's decision.

        On a daemon a growth may first wait there until the step's deadline (the source's
        ``growth_wait``): while its model is below its fair share the budget queues it ahead
        of the model's admissions and reclaim may take bytes back from a model above its
        share for it; only a growth still refused then makes a job give way."""
        while True:
            if prefilling is not None:
                rows = [prefilling]
            else:
                rows = [self._by_uid[uid] for uid in self._generation.uids]
            if not rows:
                return False
            started = time.perf_counter()
            try:
                failed = self.source.grow(cache(), n_slots(), self._grow_deadline)
            except Exception as exc:
                outcome.grow_seconds += time.perf_counter() - started
                log.exception("growing the batch's cache failed")
                for job in {*rows, *([joining] if joining is not None else [])}:
                    self.leave(job)
                    outcome.failed.append((job, exc))
                return False
            outcome.grow_seconds += time.perf_counter() - started
            if not failed:
                return True
            candidates = self._started()
            candidates += [
                j for j in (prefilling, joining) if j is not None and j not in candidates
            ]
            victim = self.preemption.growth_victim(candidates)
            if victim is None:
                for i in failed:
                    self.leave(rows[i])
                    outcome.evicted.append(rows[i])
                return False
            if victim is not joining:
                if self.on_preempt is not None:
                    self.on_preempt(victim)
                self.leave(victim)
            outcome.preempted.append(victim)
            if victim is prefilling or victim is joining:
                return False


def _tokens_of(job: Any) -> list[int]:
    """The tokens a started job's cache is to hold: its prompt, and what it generated before
    it was preempted."""
    return [*job.prompt, *job.generated]
