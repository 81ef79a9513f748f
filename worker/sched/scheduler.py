"""The generation scheduler: one thread runs every MLX evaluation of the worker.

MLX does not promise that two threads may evaluate one model at the same time, and the pooled
cache's storage expects one sequence to be driven by one thread. So the HTTP handler threads
never touch the model: they tokenize, :meth:`Scheduler.submit` a :class:`GenerationJob`, and
read its token ids from the job's event queue. One generation thread does the rest:

* **Admission, FIFO.** Jobs wait in a bounded FIFO queue. While fewer than ``max_concurrent`` jobs
  are active, the head of the queue is started: it gets a cache with a unique owner id
  (``{owner_prefix}-{n}``) and blocks are reserved before its prefill (``reserve``): with
  "on-demand" for its prompt plus ``headroom_slots`` (a block), with "prompt" for its prompt plus
  one token, with "full" for its prompt plus ``max_tokens``; it grows at block boundaries from there
  (see Preemption). With "on-demand", a job starts beside running rows only once those rows are
  backed for their next growth, a look-ahead sized from measured steps between rows ending
  (:mod:`vqpool.worker.sched.growth_forecast`): else admissions are held (``held_for_growth``)
  rather than set up a preemption a few steps later. With "auto", per request: as "on-demand"
  until this worker's requests are measured to use nearly all their ``max_tokens`` (at least
  ``WHOLE_WHEN_USED``, a moving average of the requests that ended), then as "full" (growth would
  free nothing they hold at their end, and costs growth calls and preemptions), and back to
  "on-demand" when they stop early again (and as "on-demand" a request whose whole need could
  never fit the pool alone). If the pool has too few free blocks, the head
  waits (and the jobs behind it too: a long prompt is not starved by short ones); admission is
  retried every ``retry_interval`` seconds, since blocks may be freed by another worker, and at once
  when one of this worker's jobs ends. With the daemon's pool (``source.waits``) the head instead
  asks the daemon once with ``wait`` (its remaining queue time, at most MAX_ALLOCATE_WAIT seconds)
  on the :class:`~vqpool.worker.sched.admission.AdmissionWaiter` thread, so the daemon's fair queue
  decides between models and workers, not who retries first; the generation thread keeps decoding
  and picks the granted blocks up between steps. A job that can never fit its model's share of the
  budget (the daemon's fit answer for prompt + ``max_tokens``) is refused at submit
  (:class:`NeverFitsError`, HTTP 400). A job still waiting ``queue_timeout`` seconds after it was
  submitted ends as ``rejected`` (the HTTP layer answers 503 with ``Retry-After``). A full queue
  refuses at once.
* **Decode, batched (continuous batching).** Every active job decodes in one batched forward
  pass per step (mlx-lm's ``GenerationBatch``: one token per job per step, left-padded rows,
  mlx-lm's pipelining: step n+1 is built before step n's tokens are read). Jobs join and leave
  between steps. A started job first prefills, one chunk of at most ``prefill_step_size``
  tokens per step (mlx-lm's ``PromptProcessingBatch``), so a newcomer delays the running jobs'
  next tokens by at most one chunk; its last prompt token starts its generation and it joins
  the batch. Before every forward pass the batch's cache is grown to cover the slots the pass
  writes (``source.grow``: blocks from the pool for every row, padding included, never
  inside the forward pass); a row the pool cannot grow leaves the batch first
  (see Preemption). The batching itself lives in
  :mod:`vqpool.worker.sched.continuous_batch`. Greedy tokens are those of mlx-lm's
  ``batch_generate`` with stock caches, and at batch 1 those of ``generate_step``.
  With a draft model, jobs decode one at a time by speculative decoding instead
  (:mod:`vqpool.worker.sched.speculative_batch`, as ``mlx_lm.server`` serves them), and so
  do they with ``--kv-bits`` over stock caches (``--no-pool``; mlx-lm's ``generate_step``
  quantizes each: :mod:`vqpool.worker.sched.sequential_batch`).
* **Preemption** (:mod:`vqpool.worker.sched.preemption`). When the pool refuses a growth step, the
  started job cheapest to recompute and not about to finish gives way at the step boundary: its
  blocks go back, its prompt's KV goes into the prompt cache (taking free memory only, and given
  back first when a growth is refused again), its prompt and generated tokens are kept, and it
  waits at the head of the queue (no queue timeout: it was admitted once); on resume the
  prompt cache gives its prompt back and only the rest is prefilled, and it goes on (the
  client sees one response; greedy tokens are those of a run never preempted). A reclaim ask
  from the daemon (:meth:`Scheduler.give_back`) preempts in the same order until the bytes
  asked are freed. A job the pool cannot grow while it is the only one started is
  preempted too when it could fit alone (another model or a reclaim took the room), and ends
  for lack of blocks only when it never can (:meth:`Scheduler._evict_for_lack_of_blocks`).
* **Ending.** A job ends on an EOS token (``stop``), at ``max_tokens`` (``length``), when the pool
  cannot back the next step of a job that can never fit alone (``length`` with a detail saying so;
  nothing was written), when its client went away (``cancelled``), when its text reached a stop
  string (the HTTP layer cancels it with reason ``stop``), when the pool lost its owner (``error``:
  a daemon restart conflict or an eviction freed its blocks), when vqpoold did not answer a
  growth within the pool's timeout (``length`` with a detail, or ``rejected`` if nothing was
  sent yet), on any other error (``error``; a failed batched step ends every job in the batch)
  and when the worker stops. Every ending goes
  through :meth:`Scheduler._end`, which takes the job's row out of the batch and releases its cache:
  the blocks go back to the pool however the request ended. If the generation thread itself fails,
  its jobs end as when the worker stops, and :meth:`Scheduler.submit` refuses new ones (nothing
  would run them).

With batching, a row's blocks cover the batch's buffer length, which includes its left padding:
a short request decoding beside a long one holds blocks for the long one's length. When the pool
cannot cover that padding, a request is preempted rather than ended.

* **Prompt cache** (``prompt_cache``, ``worker/kv/prompt_cache.py``). When a job's prefill begins
  (not at admission: a job admitted together with another of the same prefix finds it stored
  by then), the longest cached prefix of its tokens is copied into its cache and only the rest
  is prefilled (``job.cached_tokens``). Just before that lookup, the prompt of a job decoding in
  the batch is stored if it shares more whole blocks with the new job's tokens than the cache
  holds (concurrent requests compute a shared prefix once; a lone chat turn stores nothing
  before its first token). When a job ends (stop, length, cancelled) its prompt and generated
  tokens are stored. Cached memory goes before any request is preempted: a refused growth takes
  it first (``RowBlocks.reclaim``), and a reclaim ask is answered from it first.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationBatch, generation_stream
from vqpool.shared.errors import (
    BadRequestError,
    BlockPoolExhaustedError,
    DaemonUnavailableError,
    OverBudgetError,
)
from vqpool.shared.pool import DEFAULT_BLOCK_SIZE
from vqpool.worker.defaults import DEFAULT_PREFILL_STEP_SIZE, RESERVE_MODES
from vqpool.worker.kv.cache_source import CacheSource
from vqpool.worker.kv.prompt_cache import PromptCache
from vqpool.worker.kv.quantized import KVQuantization, prefix
from vqpool.worker.pool.client import MAX_ALLOCATE_WAIT
from vqpool.worker.sched.admission import Admission, AdmissionWaiter
from vqpool.worker.sched.continuous_batch import ContinuousBatch
from vqpool.worker.sched.growth_forecast import GrowthForecast
from vqpool.worker.sched.preemption import PreemptionPolicy, ReclaimDesk
from vqpool.worker.sched.sampling import SamplingParams
from vqpool.worker.sched.sequential_batch import SequentialBatch
from vqpool.worker.sched.serving_stats import ServingStats
from vqpool.worker.sched.speculative_batch import SpeculativeBatch

log = logging.getLogger("vqpool.worker")

DEFAULT_RETRY_INTERVAL = 0.025
"""Seconds between admission attempts while the pool is exhausted."""

WHOLE_WHEN_USED = 0.9
"""With ``--reserve auto``, requests reserve prompt + ``max_tokens`` whole once this worker's
requests use at least this share of their ``max_tokens`` (a moving average): whole reservations
then hold at most a tenth more than growth would."""

CLEAR_CACHE_EVERY = 256
"""Steps between ``mx.clear_cache()`` calls (as ``generate_step`` does every 256 tokens)."""


class QueueFullError(Exception):
    """The waiting queue is at its bound; the request was not queued."""


class ShuttingDownError(Exception):
    """The worker is stopping and takes no new requests."""


class NeverFitsError(ValueError):
    """The request can never fit its model's share of the daemon's budget (the message has
    the numbers); retrying it cannot help."""


@dataclass(frozen=True)
class ScoredToken:
    """A generated token with its log-probability, sent instead of the bare id when the job
    asked for logprobs.

    Attributes:
        token: The token id.
        logprob: Its log-probability under the model (before sampling filters).
        top: The most likely tokens as ``(id, logprob)``, most likely first (``top_logprobs``).
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class JobEnd:
    """The last event of a job.

    Attributes:
        finish_reason: "stop", "length", "cancelled", "error" or "rejected" (never started).
        prompt_tokens: Tokens of the prompt.
        completion_tokens: Tokens generated (each was sent as an event before this one).
        detail: Why, when the reason alone does not say (pool exhausted, queue timeout, error).
        status: HTTP status for "error" and "rejected" (503 when retrying later may work).
        retry_after: Seconds a client should wait before retrying a rejected request.
    """

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    detail: str | None = None
    status: int = 200
    retry_after: int | None = None


@dataclass(eq=False)
class GenerationJob:
    """One request as the scheduler runs it; ``events`` carries token ids (ScoredToken with
    ``logprobs``), then a JobEnd. ``top_logprobs`` alternatives ride on each ScoredToken."""

    prompt: Sequence[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    logprobs: bool = False
    top_logprobs: int = 0
    events: queue.SimpleQueue[int | ScoredToken | JobEnd] = field(default_factory=queue.SimpleQueue)
    cancelled: bool = False
    cancel_reason: str = "cancelled"
    owner: str | None = None
    deadline: float = 0.0
    queued_at: float = 0.0
    """When it was submitted, or last preempted (monotonic): its admission wait starts."""
    n_generated: int = 0
    generated: list[int] = field(default_factory=list)
    admission: int = 0  # rank of its first admission (among equals, the newest gives way)
    preemptions: int = 0
    resumed_from: int = 0  # tokens it had generated when it was last preempted
    admission_slots: int = 0  # token slots its admission reserves (padding included)
    whole: bool = False  # with reserve "auto": its admission reserves prompt + max_tokens
    kept_row: tuple[list[Any], list[int]] | None = None
    """A copy of its row's KV and tokens while it gives way, for the prompt cache."""
    waited_for_blocks: bool = False
    retry_at: float = 0.0
    parked: bool = False
    cache: list[Any] | None = None
    cached_tokens: int = 0
    """Prompt tokens the prompt cache gave (known once its prefill began)."""
    prompt_stored: bool = False
    """Whether its prompt was stored in the prompt cache for a later job sharing a prefix."""
    num_draft_tokens: int = 0
    """Tokens its draft model proposes per round (a worker with ``--draft-model`` only)."""


class Scheduler:
    """Runs generation jobs for one model on one thread (see the module docstring).

    Args:
        model: The mlx-lm model.
        source: Where each job's KV cache comes from (the pool, or stock caches).
        owner_prefix: Owner ids are ``{owner_prefix}-{n}``; include the pid so they are unique
            across the workers of one daemon.
        eos_token_ids: Tokens that end a job with "stop".
        max_concurrent: Jobs decoding at once (the batch size limit; prefilling jobs count).
        max_queue: Jobs waiting at once; more are refused (QueueFullError).
        queue_timeout: Seconds a job may wait before it is rejected.
        retry_interval: Seconds between admission attempts while the pool is exhausted.
        reserve: What a job reserves at admission: "on-demand" (prompt + ``headroom_slots``),
            "prompt" (prompt + 1 token), "full" (prompt + max_tokens) or "auto" (per request:
            "full" while requests use their max_tokens, else "on-demand"); a resumed job's
            generated tokens count as prompt.
        headroom_slots: The on-demand headroom, in token slots (one block of the pool).
        lost_owners: The pool's owners that are no longer this worker's (a daemon restart
            conflict, an eviction), with why: their jobs end with "error" before their next
            token, since their blocks may be handed out again.
        prefill_step_size: Prompt tokens per prefill chunk: the most a newcomer's prefill
            delays the running jobs' next tokens.
        prompt_cache: Reuses the KV of earlier requests (``worker/kv/prompt_cache.py``): looked up
            when a job's prefill starts (the prompts of running jobs sharing a prefix with it
            are stored then), stored when a job ends.
        block_size: Token slots per pool block: the unit of the look-ahead of on-demand
            admission (``growth_forecast.py``) and of what the prompt cache keeps.
        draft_model: A draft model: jobs are decoded one at a time by speculative decoding
            (:mod:`~vqpool.worker.sched.speculative_batch`), each job's cache holding both
            models' layers; ``max_concurrent`` must be 1.
        stock_quantization: ``--kv-bits`` over stock caches (``--no-pool``): jobs are decoded
            one at a time by mlx-lm's ``generate_step(kv_bits=...)``
            (:mod:`~vqpool.worker.sched.sequential_batch`), or its
            ``speculative_generate_step(kv_bits=...)`` with a draft model, as ``mlx_lm.server
            --kv-bits`` serves them; ``max_concurrent`` must be 1.
    """

    def __init__(
        self,
        model: nn.Module,
        source: CacheSource,
        *,
        owner_prefix: str,
        eos_token_ids: frozenset[int],
        max_concurrent: int,
        max_queue: int,
        queue_timeout: float,
        retry_interval: float = DEFAULT_RETRY_INTERVAL,
        reserve: str = "full",
        headroom_slots: int = 1,
        lost_owners: Callable[[], Mapping[Any, str]] | None = None,
        prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
        prompt_cache: PromptCache | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        draft_model: nn.Module | None = None,
        stock_quantization: KVQuantization | None = None,
    ) -> None:
        sequential = draft_model is not None or stock_quantization is not None
        if sequential and (max_concurrent != 1 or prompt_cache is not None):
            raise ValueError(
                "Scheduler: a draft model, or --kv-bits over stock caches, decodes one job at "
                "a time (max_concurrent 1), with no prompt cache"
            )
        if max_concurrent < 1 or max_queue < 1 or queue_timeout <= 0 or prefill_step_size < 1:
            raise ValueError(
                "Scheduler: max_concurrent, max_queue, queue_timeout and prefill_step_size "
                "must be > 0"
            )
        if reserve not in RESERVE_MODES or headroom_slots < 1:
            raise ValueError(
                f"Scheduler: reserve must be one of {RESERVE_MODES} (got {reserve!r}) and "
                f"headroom_slots >= 1 (got {headroom_slots})"
            )
        self.model = model
        self.source = source
        self.owner_prefix = owner_prefix
        self.eos_token_ids = eos_token_ids
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.retry_interval = retry_interval
        self.reserve = reserve
        self.headroom_slots = headroom_slots
        self.lost_owners = lost_owners
        self.prefill_step_size = prefill_step_size
        self.prompt_cache = prompt_cache
        self.stats = ServingStats(
            max_concurrent=max_concurrent,
            pooled=source.pooled,
            on_load=source.report_load,
            prompt_cache=None if prompt_cache is None else prompt_cache.snapshot,
        )
        self._cond = threading.Condition()
        self._waiting: deque[GenerationJob] = deque()  # guarded by _cond
        self._active: list[GenerationJob] = []  # generation thread only
        self._preemption = PreemptionPolicy(source.fits_alone, self._recompute_cost, block_size)
        self._forecast = GrowthForecast(block_size)
        self._batch: ContinuousBatch | SequentialBatch
        if stock_quantization is not None and draft_model is None:
            self._batch = SequentialBatch(
                model,
                source,
                eos_token_ids=eos_token_ids,
                prefill_step_size=prefill_step_size,
                preemption=self._preemption,
                quantization=stock_quantization,
            )
        elif draft_model is None:
            self._batch = ContinuousBatch(
                model,
                source,
                eos_token_ids=eos_token_ids,
                prefill_step_size=prefill_step_size,
                on_prefill_start=self._reuse_cached_prefix,
                preemption=self._preemption,
                on_preempt=self._keep_row,
                look_ahead=self._look_ahead if self._grows else None,
            )
        else:
            self._batch = SpeculativeBatch(
                model,
                draft_model,
                source,
                eos_token_ids=eos_token_ids,
                prefill_step_size=prefill_step_size,
                preemption=self._preemption,
                quantization=stock_quantization,
            )
        self._n_steps = 0
        self._tallied = (0, False, 0)  # (started, queued, blocks) as the last round left them
        self._tallied_at = time.monotonic()
        self._stopping = False  # guarded by _cond
        self._failed = False  # the generation thread died: stopping, and why
        self._owner_numbers = itertools.count(1)
        self._admissions = itertools.count(1)
        self._reclaims = ReclaimDesk(self._notify)
        self._thread = threading.Thread(target=self._run, name="vqpool-generation", daemon=True)
        self._waiter = AdmissionWaiter(source, self._notify) if source.waits else None

    # -- called from HTTP threads ----------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: GenerationJob) -> None:
        """Queue ``job``; its events arrive on ``job.events``.

        Raises:
            NeverFitsError: prompt + max_tokens can never fit the model's share of the budget.
            QueueFullError: ``max_queue`` jobs are waiting already.
            ShuttingDownError: The worker is stopping.
        """
        never = self.source.never_fits(len(job.prompt) + job.max_tokens)
        if never is not None:
            raise NeverFitsError(never)
        if self.prompt_cache is not None:
            # A prefix on disk is read back into the prompt cache now, on this thread, so
            # the job's prefill finds it in memory: the running rows never wait for a disk.
            self.prompt_cache.prefetch(job.prompt)
        with self._cond:
            if self._stopping:
                raise ShuttingDownError(
                    "the worker's generation thread failed (see its log)"
                    if self._failed
                    else "the worker is shutting down"
                )
            if len(self._waiting) >= self.max_queue:
                self.stats.add(rejected_queue_full=1)
                raise QueueFullError(
                    f"{len(self._waiting)} requests are already waiting (--max-queue "
                    f"{self.max_queue})"
                )
            job.queued_at = time.monotonic()
            job.deadline = job.queued_at + self.queue_timeout
            self._waiting.append(job)
            self.stats.add(requests=1, prompt_tokens=len(job.prompt))
            self.stats.set_queue_length(len(self._waiting))
            self._cond.notify()

    def cancel(self, job: GenerationJob, reason: str = "cancelled") -> None:
        """Ask for ``job`` to end: its client went away ("cancelled"), or its text reached a
        stop string ("stop"); its blocks go back within a step."""
        job.cancel_reason = reason
        job.cancelled = True
        with self._cond:
            self._cond.notify()

    def give_back(self, n_bytes: int, deadline: float) -> None:
        """The reclaim handler (``PoolClient.set_reclaim_handler``): have the generation thread
        preempt requests, newest first, at its next step boundary until ``n_bytes`` are freed
        (or none runs); returns when it did, or at the monotonic ``deadline``."""
        self._reclaims.ask(n_bytes, deadline)

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify()

    def stop(self) -> None:
        """End every job (releasing its blocks) and the generation thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()

    # -- the generation thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._tally_time()
                self._expire_waiting()
                self._answer_reclaims()
                self._admit()
                self._tallied = (len(self._active), bool(self._waiting), self.source.n_blocks())
                if self._active:
                    self._step()
                else:
                    self._idle_wait()
        except BaseException:
            log.exception("generation thread failed")
            self._failed = True
            raise
        finally:
            with self._cond:
                # No new job may be queued once this thread is gone: nothing would run it.
                self._stopping = True
            for job in list(self._active):
                self._end(job, "error", "the worker is shutting down", status=503)
            with self._cond:
                left = list(self._waiting)
                self._waiting.clear()
            for job in left:
                self._abandon(job)
                # A preempted job was answered in part: it ends as a running one does.
                reason = "error" if job.preemptions else "rejected"
                self._end(job, reason, "the worker is shutting down", status=503)
            if self._waiter is not None:
                self._waiter.stop()
            # MLX wants each thread that evaluated to destroy its streams before it ends: left
            # to the interpreter's exit, the clean-up may abort the process (std::terminate).
            mx.clear_streams()

    def _tally_time(self) -> None:
        """Count the seconds since the last round as the last round left the scheduler:
        requests started, blocks they held, and whether some waited with all
        ``max_concurrent`` started (the cap binds) or with fewer (memory binds: the pool, the
        look-ahead, the preemption window)."""
        now = time.monotonic()
        elapsed, self._tallied_at = now - self._tallied_at, now
        started, queued, blocks = self._tallied
        waited: dict[str, float] = {}
        if queued:
            at_most = started >= self.max_concurrent
            waited = {"queued_at_most_seconds" if at_most else "queued_below_most_seconds": elapsed}
        self.stats.add(row_seconds=started * elapsed, block_seconds=blocks * elapsed, **waited)

    def _expire_waiting(self) -> None:
        now = time.monotonic()
        expired: list[GenerationJob] = []
        cancelled: list[GenerationJob] = []
        with self._cond:
            if not self._waiting:
                return
            kept: deque[GenerationJob] = deque()
            for job in self._waiting:
                if job.cancelled:
                    cancelled.append(job)
                elif now >= job.deadline:
                    expired.append(job)
                else:
                    kept.append(job)
            self._waiting = kept
            self.stats.set_queue_length(len(kept))
        for job in cancelled:
            self._abandon(job)
            self._end(job, job.cancel_reason)
        head_blocked = bool(self._waiting) and self._waiting[0].waited_for_blocks
        for job in expired:
            why = (
                "the KV cache pool had too few free blocks"
                if job.waited_for_blocks or head_blocked
                else f"{self.max_concurrent} requests were running (--max-concurrent)"
            )
            self.stats.add(queue_timeouts=1)
            self._abandon(job)
            self._end(
                job,
                "rejected",
                f"waited {self.queue_timeout:g}s in the queue (--queue-timeout): {why}",
                status=503,
                retry_after=max(1, round(self.queue_timeout / 2)),
            )

    def _admit(self) -> None:
        """Start jobs from the head of the queue while there is room (module docstring)."""
        while len(self._active) < self.max_concurrent:
            with self._cond:
                if not self._waiting:
                    return
                job = self._waiting[0]
            if job.parked:
                # Granted blocks are picked up even after a preemption: they are this job's.
                if not self._collect(job):
                    return
                continue
            if not self._preemption.admits(len(self._active)):
                return
            if job.retry_at > time.monotonic():
                return
            if not self._growth_backed(job):
                return
            try:
                started = self._try_start(job)
            except Exception as exc:
                self._fail_start(job, exc)
                continue
            if not started:
                if not job.waited_for_blocks:
                    job.waited_for_blocks = True
                    self.stats.add(waits=1)
                self.stats.set_blocked(True)
                self._park_or_retry(job)
                return
            self._activate(job)

    def _growth_backed(self, job: GenerationJob) -> bool:
        """With on-demand reserves, whether the running rows are backed for their next growth
        (:mod:`~vqpool.worker.sched.growth_forecast`) and for ``job``'s tokens, which pad them
        when it joins, so that ``job`` may start beside them; when not, admissions are
        held."""
        if not self._grows or self._whole_by_measure():
            return True
        if self._forecast.holds(len(self._active)):
            return False
        joined = max(self._batch.used_slots(), len(job.prompt) + len(job.generated))
        if self._batch.back_ahead(joined + self._forecast.look_ahead_slots()):
            return True
        self._forecast.hold(len(self._active))
        self.stats.add(held_for_growth=1)
        return False

    def _park_or_retry(self, job: GenerationJob) -> None:
        """The head cannot start now: wait at the daemon if it can, else retry soon."""
        now = time.monotonic()
        if self._waiter is None or self._waiter.busy or job.deadline <= now:
            # No daemon, or the waiter still waits for a job that went away: poll meanwhile.
            job.retry_at = now + self.retry_interval
            return
        assert job.cache is not None
        job.parked = True
        job.retry_at = job.deadline
        self._waiter.park(
            job, job.cache, job.admission_slots, min(job.deadline - now, MAX_ALLOCATE_WAIT)
        )

    def _collect(self, job: GenerationJob) -> bool:
        """Pick up the parked head's outcome; False while it still waits at the daemon."""
        assert self._waiter is not None
        admission: Admission | None = self._waiter.outcome(job)
        if admission is None:
            return False
        job.parked = False
        if isinstance(admission.error, BadRequestError) and "'wait'" in str(admission.error):
            # A daemon older than waiting allocations: poll it, as before.
            log.warning("vqpoold cannot wait for allocations (%s): polling", admission.error)
            self._waiter.stop()
            self._waiter = None
            job.retry_at = 0.0
        elif admission.error is not None:
            self._fail_start(job, admission.error)
        elif admission.exhausted:
            # The wait ran out before the queue timeout (its cap), or the daemon could not
            # wait (no budget binds: the block ids ran out): ask again after the usual pause.
            job.retry_at = time.monotonic() + self.retry_interval
        else:
            assert job.cache is not None
            try:
                self.source.adopt(job.cache, job.admission_slots, admission.taken)
                self._queue_prefill(job)
            except Exception as exc:
                self._fail_start(job, exc)
                return True
            self._activate(job)
        return True

    def _fail_start(self, job: GenerationJob, exc: Exception) -> None:
        self._pop_head(job)
        # Over budget: the model's limit or the budget was lowered after submit's fit check.
        status = (
            503
            if isinstance(exc, DaemonUnavailableError)
            else 400
            if isinstance(exc, OverBudgetError)
            else 500
        )
        log.error("could not start a request: %s", exc)
        self._end(job, "error", f"could not start: {exc}", status=status)

    def _activate(self, job: GenerationJob) -> None:
        self._pop_head(job)
        self.stats.set_blocked(False)
        waited = time.monotonic() - job.queued_at
        if not job.admission:
            job.admission = next(self._admissions)
            self.stats.add(
                admitted=1, admission_wait_seconds=waited, reserved_whole=1 if job.whole else 0
            )
        else:
            self.stats.add(resume_wait_seconds=waited)
        self._active.append(job)
        self.stats.set_active(len(self._active))

    def _abandon(self, job: GenerationJob) -> None:
        """``job`` leaves the queue: a call parked for it must not hand it blocks any more."""
        if job.parked and self._waiter is not None:
            self._waiter.abandon(job)
            job.parked = False

    def _pop_head(self, job: GenerationJob) -> None:
        with self._cond:
            if self._waiting and self._waiting[0] is job:
                self._waiting.popleft()
            self.stats.set_queue_length(len(self._waiting))

    @property
    def _grows(self) -> bool:
        """Whether requests may start with less than their whole need and grow on demand, the
        look-ahead backing the running rows' growth before another starts."""
        return self.reserve in ("on-demand", "auto")

    def _slots_for(self, job: GenerationJob) -> int:
        # generate_step writes the KV of every token it yields, the last one included: a job
        # needs prompt + max_tokens slots in all.
        if self.reserve == "full" or job.whole:
            slots = len(job.prompt) + job.max_tokens
        else:
            headroom = self.headroom_slots if self._grows else 1
            slots = min(
                len(job.prompt) + len(job.generated) + headroom, len(job.prompt) + job.max_tokens
            )
        if isinstance(self._batch, SequentialBatch):
            # A round writes its drafts too: admitted (or resumed) with less, it could never
            # make its next round, and a preemption would bring it back to the same place.
            slots = max(slots, self._batch.round_slots(job))
        return slots

    def _admission_slots(self, job: GenerationJob) -> int:
        """What ``job``'s admission reserves: :meth:`_slots_for`, and with on-demand reserves
        at least the batch's length when it will join (the batch's rows used now, one slot per
        step of its prefill, and its first token: a row is padded to the batch's length), so
        that its join does not make it, or a running row, give way at once. Not when that
        could never fit alone (then joining is left to growth, as before)."""
        slots = self._slots_for(job)
        if not self._grows:
            return slots
        used = self._batch.used_slots()
        if not used:
            return slots
        n_tokens = len(job.prompt) + len(job.generated)
        joined = used + -(-n_tokens // self.prefill_step_size) + 1
        if joined <= slots or not self.source.fits_alone(joined):
            return slots
        return joined

    def _whole_by_measure(self) -> bool:
        """With ``reserve`` "auto": whether requests reserve their whole need (prompt +
        ``max_tokens``), as with "full" (no look-ahead either), rather than grow on demand:
        they do once this worker's requests use at least :data:`WHOLE_WHEN_USED` of their
        ``max_tokens`` (measured, :attr:`GrowthForecast.used
        <vqpool.worker.sched.growth_forecast.GrowthForecast.used>`). Growth would then free
        nothing they hold at their end, and it costs growth calls (each a round trip to
        vqpoold on the generation thread) and preemptions."""
        used = self._forecast.used
        return self.reserve == "auto" and used is not None and used >= WHOLE_WHEN_USED

    def _look_ahead(self) -> int:
        """Slots a decode step's growth asks for ahead (0: none, requests reserve whole)."""
        return 0 if self._whole_by_measure() else self._forecast.look_ahead_slots()

    def _try_start(self, job: GenerationJob) -> bool:
        """Back the job's prompt with cache memory and queue its prefill; False if the pool
        has too few free blocks now (the job keeps its owner id and empty cache for the retry)."""
        if job.cache is None:
            job.owner = f"{self.owner_prefix}-{next(self._owner_numbers)}"
            job.cache = self._open_cache(job.owner)
        if job.preemptions and self.prompt_cache is not None:
            self.prompt_cache.touch([*job.prompt, *job.generated])
        # Never whole what the pool could not hold alone: it would wait until its queue
        # timeout, where growing it runs it until the pool runs out (then "length").
        job.whole = self._whole_by_measure() and self.source.fits_alone(
            len(job.prompt) + job.max_tokens
        )
        job.admission_slots = self._admission_slots(job)
        try:
            self.source.reserve(job.cache, job.admission_slots)
        except BlockPoolExhaustedError:
            return False
        self._queue_prefill(job)
        return True

    def _open_cache(self, owner: str) -> list[Any]:
        """The seam where a job's own cache is made, before it joins the batch: empty today
        (the whole prompt is prefilled). A prompt cache would hand one holding a cached prefix
        of the prompt; :meth:`ContinuousBatch.start` then prefills only the rest."""
        return self.source.open(owner)

    def _queue_prefill(self, job: GenerationJob) -> None:
        """Queue the started job for its prefill (it joins the batch when that is done)."""
        self._batch.start(job)
        self._sample_memory()

    def _reuse_cached_prefix(self, job: GenerationJob, tokens: list[int]) -> None:
        """Called by the batch when ``job``'s prefill begins: copy the longest cached prefix of
        ``tokens`` (its prompt, and what it generated if it was preempted) into its cache
        (backed for them already), so only the rest is prefilled."""
        reused = 0
        if self.prompt_cache is not None and job.cache is not None:
            self._store_prompts_sharing(job, tokens)
            reused = self.prompt_cache.reuse(tokens, job.cache)
            if not job.generated:  # usage reports the prompt tokens of its first start
                job.cached_tokens = reused
        prefilled = len(tokens) - reused
        self.stats.add(
            prefill_tokens=prefilled, recompute_tokens=prefilled if job.preemptions else 0
        )

    def _store_prompts_sharing(self, job: GenerationJob, tokens: Sequence[int]) -> None:
        """Store the prompt of each job in the batch (not stored yet) that shares more whole
        blocks with ``tokens`` than the cache gives them, so ``job`` reuses it: a prefix that
        concurrent requests share is computed once. Done here, when a job that can use it
        begins, rather than when every prompt is prefilled: a store copies the whole prompt
        (and asks the pool for blocks), and a job with no such follower (a chat's next turn)
        would pay that before its first token for nothing."""
        assert self.prompt_cache is not None
        block_size = self.prompt_cache.block_size
        usable = len(tokens) - 1  # a prefix of at most all but the last token is reused
        cached: int | None = None
        for other in self._active:
            if other is job or other.prompt_stored:
                continue
            shared = common_prefix_length(other.prompt, tokens, usable)
            if shared < block_size:
                continue
            if cached is None:
                cached = self.prompt_cache.cached_prefix_length(tokens)
            if shared // block_size <= cached // block_size:
                continue
            row = self._batch.row_kv(other)
            if row is None:  # not in the batch (waiting for its prefill)
                continue
            self._store_in_prompt_cache(other.prompt, row[0])
            other.prompt_stored = True
            cached = shared

    def _store_in_prompt_cache(self, tokens: Sequence[int], kv: Sequence[Any]) -> None:
        """Keep the KV of ``tokens`` (``kv``: one stock cache per layer holding them from
        position 0, as the batch extracts a row) for later jobs."""
        if self.prompt_cache is None or not kv:
            return
        n = min(len(tokens), kv[0].offset)
        if n > 0:
            layers = [(prefix(layer.keys, n), prefix(layer.values, n)) for layer in kv]
            self.prompt_cache.store(list(tokens[:n]), layers)

    def _keeps_prompts(self) -> bool:
        return self.prompt_cache is not None and self.prompt_cache.max_bytes > 0

    def _recompute_cost(self, job: GenerationJob) -> int:
        """Tokens ``job`` would prefill again if it gave way now: in its prefill, what it
        prefilled so far; in the batch, its prompt and generated tokens but a prompt of a block
        or more, which the prompt cache keeps for its resume (:meth:`_keep_row`)."""
        if not self._batch.in_batch(job):
            return job.cache[0].size() if job.cache is not None else 0
        tokens = len(job.prompt) + len(job.generated)
        if not self._keeps_prompts():
            return tokens
        assert self.prompt_cache is not None
        return tokens - (len(job.prompt) if len(job.prompt) >= self.prompt_cache.block_size else 0)

    def _keep_row(self, job: GenerationJob) -> None:
        """``job`` gives way to a refused growth: copy its row's KV, so that its prompt goes
        into the prompt cache once its blocks are back (:meth:`_preempt`) and its resume
        prefills only what the cache lacks."""
        if self._keeps_prompts() and not job.prompt_stored:
            job.kept_row = self._batch.row_kv(job)

    def _end_lost_jobs(self) -> None:
        """End the jobs whose owner the pool lost: their blocks are not theirs any more."""
        lost = self.lost_owners() if self.lost_owners is not None else None
        if not lost:
            return
        for job in list(self._active):
            why = lost.get(job.owner)
            if why is not None:
                log.error("request %s ended: %s", job.owner, why)
                self._end(job, "error", why, status=500)

    def _step(self) -> None:
        """One step: a batched decode step of every job in the batch, then one prefill chunk
        (see :class:`~vqpool.worker.sched.continuous_batch.ContinuousBatch`)."""
        self._end_lost_jobs()
        for job in list(self._active):
            if job.cancelled:
                self._end(job, job.cancel_reason)
        started = time.perf_counter()
        with mx.stream(generation_stream):
            outcome = self._batch.step()
        self._evict_for_lack_of_blocks(outcome.evicted)
        for job in outcome.preempted:
            self._preempt(job)
        for job, exc in outcome.failed:
            self._end_failed(job, exc)
        for job, token, logprobs in outcome.tokens:
            job.n_generated += 1
            job.generated.append(token)
            job.events.put(_scored(token, logprobs, job.top_logprobs) if job.logprobs else token)
        for job, reason, response in outcome.finished:
            self._row_finished(job, reason, response)
        self._n_steps += 1
        self._forecast.stepped()
        if self._n_steps % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()
        self._sample_memory()
        self.stats.add(
            completion_tokens=len(outcome.tokens),
            draft_accepted=outcome.drafted,
            busy_seconds=time.perf_counter() - started,
            decode_steps=1 if outcome.decoded_rows else 0,
            decode_rows=outcome.decoded_rows,
            decode_slots=outcome.held_slots,
            token_slots=outcome.token_slots,
            grow_seconds=outcome.grow_seconds,
            prefill_seconds=outcome.prefill_seconds,
        )

    def _end_failed(self, job: GenerationJob, exc: Exception) -> None:
        """End ``job``, taken out of the batch because its step raised ``exc``. When the
        daemon did not answer a growth, the job ends with what its blocks held ("length", a
        detail naming the daemon; its client keeps what it got), or, if it has sent nothing
        yet, is refused with 503 to be retried: its blocks are its own, and go back when the
        daemon answers again (``PoolClient`` keeps the frees)."""
        if not isinstance(exc, DaemonUnavailableError):
            self._end(job, "error", f"generation failed: {exc}", status=500)
        elif job.n_generated:
            detail = f"ended after {job.n_generated} tokens, when its blocks were full: {exc}"
            self._end(job, "length", detail)
        else:
            self._end(job, "rejected", f"could not start: {exc}", status=503, retry_after=1)

    def _row_finished(
        self, job: GenerationJob, reason: str, response: GenerationBatch.Response
    ) -> None:
        """``job`` reached EOS ("stop") or ``max_tokens`` ("length"); the batch already took
        its row out. The seam for a prompt cache: ``response.prompt_cache`` holds the row's KV
        (stock ``KVCache`` copies, no blocks) and ``response.all_tokens`` the token ids it
        covers, kept in the prompt cache once the job's blocks are back (mlx-lm's batch drops
        its last row without releasing it): the new entry may take them."""
        self._release(job)
        if response.prompt_cache and response.all_tokens is not None:
            self._store_in_prompt_cache(response.all_tokens, response.prompt_cache)
        self._end(job, reason)

    def _evict_for_lack_of_blocks(self, jobs: list[GenerationJob]) -> None:
        """The pool could not back the next forward pass of ``jobs``, which the batch took
        out, and no other started job of this worker could give way. A job that could fit
        alone was refused for the pool's other users (another model, or a reclaim): it is
        preempted, and waits for its blocks. One that can never fit alone ends ("length"). The
        preemption policy decides which."""
        for job in jobs:
            n_tokens = self._slots_for(job)  # what its admission will reserve again
            if self._preemption.preempts_alone(n_tokens):
                self._preempt(job)
                continue
            self.stats.add(exhaustions=1)
            self._end(
                job,
                "length",
                f"the KV cache pool ran out of blocks after {job.n_generated} generated "
                f"tokens: the {n_tokens} token slots it would need to resume can never fit in "
                "the pool or the model's share of the budget, even alone "
                "(BlockPoolExhaustedError)",
            )

    def _preempt(self, job: GenerationJob) -> None:
        """``job`` gives way: out of the batch, blocks back, requeued at the head with what it
        generated (module docstring); nothing is sent to its client."""
        self._batch.leave(job)
        self._release(job)
        if job.kept_row is not None:
            # Its blocks are back: the entry takes what is free, and goes first when a growth
            # is refused again (cached memory before requests).
            kv, covered = job.kept_row
            job.kept_row = None
            # Quantized KV keeps every token it covers: recomputing the generated tokens would
            # run their first pass in full precision (maybe_quantize_kv_cache quantizes after
            # a pass), which is not what decoding them computed.
            quantized = bool(kv) and isinstance(kv[0].keys, tuple)
            self._store_in_prompt_cache(covered if quantized else job.prompt, kv)
            job.prompt_stored = True
        if job in self._active:
            self._active.remove(job)
            self.stats.set_active(len(self._active))
        self._forecast.refused()
        job.preemptions += 1
        job.resumed_from = len(job.generated)
        job.deadline = math.inf  # admitted once: the queue timeout is not for it
        job.queued_at = time.monotonic()
        job.retry_at = 0.0
        job.waited_for_blocks = False
        with self._cond:
            self._waiting.insert(self._preemption.requeue_position(self._waiting), job)
            self.stats.set_queue_length(len(self._waiting))
        self._preemption.preempted(len(self._active))
        self._sample_memory()
        self.stats.add(preemptions=1)
        log.info(
            "request %s preempted after %d generated tokens (resumes at the queue's head)",
            job.owner,
            job.n_generated,
        )

    def _answer_reclaims(self) -> None:
        """Answer the reclaim asks filed since the last step boundary: the prompt cache gives
        back entries, least recently used first, then the running jobs the preemption policy
        names (the newest first) are preempted until each ask's bytes are freed."""
        for ask in self._reclaims.take():
            self._forecast.refused()
            # The prompt cache's blocks are the pool client's too: what it gives back shows in
            # held_bytes already, and is counted once.
            before = self.source.held_bytes()
            # Cached memory goes first; requests are preempted only for what it cannot give.
            if self.prompt_cache is not None:
                self.prompt_cache.release_bytes(ask.n_bytes)
            while True:
                freed = before - self.source.held_bytes()
                victim = self._preemption.reclaim_victim(self._active, freed, ask.n_bytes)
                if victim is None:
                    break
                self._preempt(victim)
                self.stats.add(reclaim_preemptions=1)
            ask.freed = max(0, before - self.source.held_bytes())
            ask.done.set()

    def _idle_wait(self) -> None:
        """Sleep until a job arrives or is cancelled, the head's retry is due, or a deadline."""
        with self._cond:
            if self._stopping:
                return
            if self._reclaims.pending():
                return
            if not self._waiting:
                self._cond.wait()
                return
            now = time.monotonic()
            wake = min(min(job.deadline for job in self._waiting), self._waiting[0].retry_at)
            if wake == math.inf:  # only preempted jobs, parked at the daemon
                self._cond.wait()
            elif wake > now:
                self._cond.wait(wake - now)

    def _sample_memory(self) -> None:
        self.stats.set_memory(self.source.n_blocks(), self.source.nbytes())

    def _end(
        self,
        job: GenerationJob,
        reason: str,
        detail: str | None = None,
        *,
        status: int = 200,
        retry_after: int | None = None,
    ) -> None:
        """End ``job``: take it out of the batch, release its cache, send its JobEnd."""
        # Ended by a stop string or its client while in the batch: keep what it computed (a
        # copy of its row, stored once its blocks are back).
        row = self._batch.row_kv(job) if reason in ("stop", "cancelled") else None
        try:
            self._batch.leave(job)
        except Exception:
            # Its blocks still go back below; the batch it was in failed (its jobs end too).
            log.exception("taking request %s out of the batch failed", job.owner)
        self._release(job)
        if row is not None:
            self._store_in_prompt_cache(row[1], row[0])
        if job in self._active:
            self._active.remove(job)
            self.stats.set_active(len(self._active))
            self._forecast.row_ended()
            self._preemption.ended()
            # A request the pool ran out of blocks for (a detail) says nothing of its own end.
            if reason == "stop" or (reason == "length" and detail is None):
                self._forecast.request_ended(job.n_generated, job.max_tokens)
        self._sample_memory()
        self.stats.add(**{f"ended_{reason}": 1})
        job.events.put(
            JobEnd(reason, len(job.prompt), job.n_generated, detail, status, retry_after)
        )

    def _release(self, job: GenerationJob) -> None:
        """Give ``job``'s cache back (its blocks go back to the pool)."""
        if job.cache is not None:
            cache, job.cache = job.cache, None
            try:
                self.source.release(cache)
            except Exception as exc:
                # The memory is dropped either way; the daemon frees the blocks of this
                # session when the worker exits.
                log.warning("releasing %s failed: %s", job.owner, exc)
            with self._cond:
                if self._waiting:
                    self._waiting[0].retry_at = 0.0  # blocks may be free now: retry at once


def common_prefix_length(a: Sequence[int], b: Sequence[int], most: int) -> int:
    """How many leading tokens ``a`` and ``b`` share, at most ``most``."""
    n = 0
    for mine, theirs in zip(a[:most], b[:most], strict=False):
        if mine != theirs:
            break
        n += 1
    return n


def _scored(token: int, logprobs: mx.array, n_top: int) -> ScoredToken:
    """``token`` with its log-probability and the ``n_top`` most likely tokens'."""
    top: tuple[tuple[int, float], ...] = ()
    n_top = min(n_top, logprobs.size)
    if n_top > 0:
        ids = mx.argpartition(-logprobs, kth=n_top - 1)[:n_top]
        id_list: list[int] = ids.tolist()  # type: ignore[assignment]
        value_list: list[float] = logprobs[ids].tolist()  # type: ignore[assignment]
        top = tuple(sorted(zip(id_list, value_list, strict=True), key=lambda pair: -pair[1]))
    logprob: float = logprobs[token].item()  # type: ignore[assignment]
    return ScoredToken(token, logprob, top)
