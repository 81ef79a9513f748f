#!/usr/bin/env python3
"""Does elastic memory pay? Tier 1: a simulator with a virtual clock driving the daemon's real
ledger (daemon/budget/ledger.py) and reclaim book (daemon/budget/reclaim_book.py) in process,
no sleeps.

One seeded trace of three models sharing one KV budget:

- ``steady``: Poisson arrivals, medium prompts;
- ``bursty``: on/off (bursts of 3x its mean rate for 8 s, then silence for 16 s);
- ``longctx``: rare requests with long contexts.

Request lengths are log-normal. Every model has one simulated worker that batches continuously:
a step decodes one token of every running request and prefills the requests admitted at its
start; its duration comes from the cost model below. Three policies, same trace, same worker:

- ``elastic``: reserves as guarantees (``lend_reserves``): a model may borrow others' idle
  reserves, and a model below its reserve (or its fair share) that waits gets bytes back by
  reclaim: the workers of the models above their share preempt their newest requests at their
  next step boundary (recomputed later) and answer. Requests grow block by block; a growth the
  ledger refuses preempts the worker's own newest request (vLLM's recompute preemption).
- ``static``: each model confined to a fixed split of the budget (reserve = limit = its part),
  the best split of a grid searched by capacity (an oracle no operator has).
- ``shared``: one pool, no reserves, weighted max-min hand-out (the daemon of issue 11).

Figures: capacity (the highest load multiplier at which 99% of requests get their first token
within the TTFT objective; bisection), p99 TTFT per model at the elastic capacity, the share of
time each model spends below its reserve while it has waiting demand, and throughput (tokens/s)
under steady overload (bursts replaced by their mean rate).

    scripts/bench_elastic.py            # full run (a few minutes on 2 vCPUs)
    scripts/bench_elastic.py --quick    # a smoke run of every figure (seconds)

Cost model (seconds): a step costs ``STEP_BASE + DECODE_PER_SEQ * decoding + PREFILL_PER_TOKEN *
prefill tokens``; a preempted request's resume prefills its prompt and generated tokens again.
The constants are llama-tiny's on this machine kind (the team's shared MEMORY.md, "Costs measured",
a quiet 2-vCPU Linux box): re-prefilling 1,024 tokens 0.22 s; decode batch 1 725 tok/s, batch 16
5,800 tok/s, i.e. a step of 1.38 ms at batch 1 and 2.76 ms at batch 16. ``--calibrate``
re-measures them with the built-in tiny llama (``scripts/bench_elastic.py --calibrate``); on the
shared box at load average 11 it printed STEP_BASE 1.7-3.2e-3, DECODE_PER_SEQ 1.9e-4,
PREFILL_PER_TOKEN 0.78-1.8e-3 (inflated 3-8x by the load), so the quiet figures stay.

Tier 2 (``--tier2``): the real vqpoold with ``--lend-reserves``; a simulated borrowing worker
process (a PoolClient with a reclaim handler, whose steps are calibrated sleeps) keeps the pool
full on loan, and a model with a reserve asks for it again and again (``allocate`` with
``wait``). Reports the daemon's reclaim latency p50/p99 and the owner's wait against one decode
step (target: p99 at most one decode step + 20 ms).

Tier 3 (``--tier3``, ``scripts/bench_elastic_tier3.py``): real ``vqpool-worker`` processes with
the built-in tiny llama, a shorter trace with lengths and budget scaled down; elastic against
shared today, TTFT measured by streaming clients.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import math
import random
import statistics
import sys
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from vqpool.daemon.budget.ledger import BudgetLedger, ModelSettings, Outcome
from vqpool.daemon.budget.reclaim_book import ReclaimAsk, ReclaimBook, plan_reclaim

STEP_BASE = 1.29e-3
DECODE_PER_SEQ = 0.092e-3
PREFILL_PER_TOKEN = 0.215e-3
"""llama-tiny on a 2-vCPU Linux box (see the module docstring; ``--calibrate`` re-measures)."""

BLOCK_TOKENS = 16
HEADROOM_BLOCKS = 1
"""Blocks admitted beyond the prompt (grow-on-demand admits the prompt plus this)."""
MAX_BATCH = 32
PREFILL_CHUNK = 2048
"""Most prompt tokens one step prefills (chunked prefill: a long prompt does not stall the
decodes of the batch for seconds); an admission beyond it waits for the next step."""
RECLAIM_DEADLINE = 0.5
GROWTH_WAIT = 0.1
"""Seconds a worker's step may wait for its growths at the ledger (``--growth-wait``, the
worker's default): a growth its model is owed waits ahead of the model's admissions while
reclaim takes bytes back for it; one still refused then preempts."""
TTFT_OBJECTIVE = 1.0
"""Seconds to first token that 99% of requests must meet."""
ATTAINMENT = 0.99


@dataclass(frozen=True)
class ModelSpec:
    """One model of the trace: its KV bytes per token, arrival pattern and lengths."""

    name: str
    bytes_per_token: int
    rate: float  # mean requests/s at load 1
    prompt_median: int
    prompt_sigma: float
    output_median: int
    output_sigma: float
    burst_on: float = 0.0  # seconds on (0: Poisson all the time)
    burst_off: float = 0.0
    max_context: int = 16384


MODELS = (
    ModelSpec("steady", 2048, 1.0, 256, 0.5, 1536, 0.5),
    ModelSpec("bursty", 2048, 2.0, 256, 0.5, 128, 0.5, burst_on=8.0, burst_off=16.0),
    ModelSpec("longctx", 2048, 0.1, 3072, 0.3, 256, 0.4),
)
BUDGET = 8192 * 2048  # 16 MiB: 8,192 tokens of KV
RESERVES = {"steady": 0.3, "bursty": 0.3, "longctx": 0.4}
"""Reserves of the elastic policy, as shares of the budget."""


@dataclass
class Request:
    rid: int
    model: int
    arrival: float
    prompt: int
    output: int
    generated: int = 0
    first_token: float | None = None
    finished: float | None = None
    held_blocks: int = 0
    preemptions: int = 0
    admitted_seq: int = 0

    @property
    def context(self) -> int:
        return self.prompt + self.generated


def make_trace(seed: int, duration: float, load: float, steady_only: bool = False) -> list[Request]:
    """Arrivals of every model in time order (one seeded draw per model, so a load change keeps
    each model's length sequence)."""
    requests: list[Request] = []
    for index, spec in enumerate(MODELS):
        rng = random.Random(seed * 1000 + index)
        t = 0.0
        cycle = spec.burst_on + spec.burst_off
        on_rate = spec.rate * (cycle / spec.burst_on if cycle and not steady_only else 1.0)
        rate = on_rate * load
        while True:
            t += rng.expovariate(rate)
            if cycle and not steady_only and (t % cycle) >= spec.burst_on:
                t += cycle - (t % cycle)  # skip the silence
                continue
            if t >= duration:
                break
            prompt = _length(rng, spec.prompt_median, spec.prompt_sigma, spec.max_context // 2)
            output = _length(rng, spec.output_median, spec.output_sigma, spec.max_context // 4)
            requests.append(Request(0, index, t, prompt, output))
    requests.sort(key=lambda r: r.arrival)
    for rid, request in enumerate(requests):
        request.rid = rid
    return requests


def _length(rng: random.Random, median: int, sigma: float, cap: int) -> int:
    return max(1, min(cap, int(median * math.exp(rng.gauss(0.0, sigma)))))


@dataclass
class Policy:
    name: str
    settings: dict[str, ModelSettings]
    lend: bool
    reclaim: bool
    reclaim_up_to_share: bool = True
    """Reclaim for fair shares too, as the daemon does (False: restore reserves only)."""
    reserve_full: bool = False
    """Admit a request with the blocks of its prompt and all its output (today's
    ``--reserve full``: no growth, no preemption) instead of its prompt plus headroom."""


def elastic_policy() -> Policy:
    settings = {s.name: ModelSettings(reserve=int(BUDGET * RESERVES[s.name])) for s in MODELS}
    return Policy("elastic", settings, lend=True, reclaim=True)


def static_policy(split: Sequence[float]) -> Policy:
    settings = {}
    for spec, share in zip(MODELS, split, strict=True):
        part = int(BUDGET * share)
        settings[spec.name] = ModelSettings(reserve=part, limit=part)
    label = "/".join(f"{round(s * 100)}" for s in split)
    return Policy(f"static {label}", settings, lend=False, reclaim=False)


def shared_policy(reserve_full: bool = True) -> Policy:
    name = "shared today" if reserve_full else "shared+grow"
    return Policy(name, {}, lend=False, reclaim=False, reserve_full=reserve_full)


def static_splits(step: int) -> Iterator[tuple[float, ...]]:
    """Every split of the budget into three positive parts in 1/step units."""
    for a in range(1, step - 1):
        for b in range(1, step - a):
            yield (a / step, b / step, (step - a - b) / step)


@dataclass
class Worker:
    """One model's worker: a queue, the running batch, and its step in progress."""

    index: int
    spec: ModelSpec
    queue: deque[Request] = field(default_factory=deque)
    running: list[Request] = field(default_factory=list)
    prefilling: list[Request] = field(default_factory=list)
    busy_until: float | None = None
    waiting: Request | None = None  # the request whose admission is parked at the ledger
    waiting_ticket: int = 0
    granted: Request | None = None  # ... and granted (charged), to admit at the next boundary
    ask: ReclaimAsk | None = None
    held_at_ask: int = 0
    preemptions: int = 0
    growth: tuple[Request, int] | None = None  # a growth waiting at the ledger, and its ticket
    grow_deadline: float = 0.0  # until when this step's growths may wait
    step_preempted: bool = False  # this step preempted (it admits nothing)
    event: int = -1  # the seq of the worker's live event (a step end or a growth's deadline)

    @property
    def block_bytes(self) -> int:
        return self.spec.bytes_per_token * BLOCK_TOKENS


@dataclass
class Result:
    policy: str
    requests: list[Request]
    duration: float
    below_reserve_with_demand: dict[str, float]
    reclaim_latencies: list[float]
    reclaims_late: int
    preemptions: int
    tokens: int

    def attainment(self) -> float:
        met = sum(
            1
            for r in self.requests
            if r.first_token is not None and r.first_token - r.arrival <= TTFT_OBJECTIVE
        )
        return met / len(self.requests) if self.requests else 1.0

    def p99_ttft(self, model: int) -> float:
        waits = sorted(
            (r.first_token if r.first_token is not None else math.inf) - r.arrival
            for r in self.requests
            if r.model == model
        )
        if not waits:
            return 0.0
        return waits[min(len(waits) - 1, int(0.99 * len(waits)))]


class Simulation:
    """The trace played against one policy. ``check`` runs the ledger's recount and the
    simulator's own invariants after every event (slow; for tests)."""

    def __init__(
        self,
        policy: Policy,
        trace: list[Request],
        check: bool = False,
        growth_wait: float = GROWTH_WAIT,
    ) -> None:
        self.policy = policy
        self.ledger = BudgetLedger(
            BUDGET,
            policy.settings,
            lend_reserves=policy.lend,
            max_waiting_per_model=4,
            max_waiting=16,
        )
        self.book = ReclaimBook(RECLAIM_DEADLINE)
        self.growth_wait = growth_wait
        self.workers = [Worker(i, spec) for i, spec in enumerate(MODELS)]
        self.trace = [Request(r.rid, r.model, r.arrival, r.prompt, r.output) for r in trace]
        self.check = check
        self.now = 0.0
        self._tickets = itertools.count(1)
        self._ticket_owner: dict[int, tuple[Worker, Request]] = {}
        self._growth_owner: dict[int, Worker] = {}
        self._admissions = itertools.count(1)
        self._events: list[tuple[float, int, int]] = []  # (time, seq, worker) step ends
        self._seq = itertools.count()
        self._below: dict[str, float] = {s.name: 0.0 for s in MODELS}
        self.latencies: list[float] = []
        self.tokens = 0

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> Result:
        arrivals = deque(self.trace)
        end = (self.trace[-1].arrival if self.trace else 0.0) + 60.0
        while arrivals or self._events:
            next_arrival = arrivals[0].arrival if arrivals else math.inf
            next_step = self._events[0][0] if self._events else math.inf
            t = min(next_arrival, next_step)
            if t > end:
                break
            self._advance(t)
            if next_arrival <= next_step:
                request = arrivals.popleft()
                worker = self.workers[request.model]
                worker.queue.append(request)
                if worker.busy_until is None:
                    self._start_step(worker)
            else:
                _, seq, index = heapq.heappop(self._events)
                worker = self.workers[index]
                if seq == worker.event:  # else a growth's deadline after its grant: stale
                    if worker.growth is not None:
                        self._growth_timed_out(worker)
                    else:
                        self._end_step(worker)
            self._after_change()
            if self.check:
                self._check()
        duration = self.now
        return Result(
            self.policy.name,
            self.trace,
            duration,
            {k: v / duration if duration else 0.0 for k, v in self._below.items()},
            self.latencies,
            self.book.stats.late,
            sum(w.preemptions for w in self.workers),
            self.tokens,
        )

    def _advance(self, t: float) -> None:
        """Move the clock, counting time spent below reserve with waiting demand: an admission
        parked at the ledger for bytes (a request that only waits for its worker's next step
        boundary is not waiting for memory)."""
        dt = t - self.now
        if dt > 0:
            for worker in self.workers:
                settings = self.policy.settings.get(worker.spec.name)
                below = (
                    settings is not None and self.ledger.held(worker.spec.name) < settings.reserve
                )
                waiting = worker.waiting is not None or worker.growth is not None
                if waiting and below:
                    self._below[worker.spec.name] += dt
        self.now = t

    # -- one worker's steps -------------------------------------------------------------------

    def _start_step(self, worker: Worker) -> None:
        """At a step boundary: answer a reclaim ask, admit, grow, and schedule the step."""
        if worker.ask is not None:
            self._give_back(worker)
        # Running requests grow first; a step that had to preempt admits nothing (vLLM's
        # rule: admitting then would take the bytes the preempted request just gave back).
        # A parked admission is withdrawn meanwhile and asked again after the growths (the
        # simulator's model of admission since tier 1 began; the real worker keeps it parked,
        # and its growths go ahead of it at the ledger: docs/elastic.md, "Known limits").
        # A worker left with nothing running asks anyway: its parked admission is the demand
        # the ledger sees (and reclaims for).
        self._withdraw(worker)
        worker.step_preempted = False
        worker.grow_deadline = self.now + self.growth_wait
        self._continue_step(worker)

    def _continue_step(self, worker: Worker) -> None:
        """Grow, admit and schedule the step; or pause while a growth waits at the ledger."""
        self._grow(worker)
        if worker.growth is not None:
            return  # resumed by its grant (_after_change) or its deadline (_growth_timed_out)
        if not worker.step_preempted or not worker.running:
            self._admit(worker)
        decoding = len(worker.running)
        prefill = sum(r.context for r in worker.prefilling)
        if not decoding and not prefill:
            worker.busy_until = None
            return
        cost = STEP_BASE + DECODE_PER_SEQ * decoding + PREFILL_PER_TOKEN * prefill
        self._schedule(worker, self.now + cost)

    def _schedule(self, worker: Worker, at: float) -> None:
        worker.busy_until = at
        worker.event = next(self._seq)
        heapq.heappush(self._events, (at, worker.event, worker.index))

    def _end_step(self, worker: Worker) -> None:
        for request in worker.running:
            request.generated += 1
            self.tokens += 1
        for request in worker.prefilling:
            if request.first_token is None:
                request.first_token = self.now
                request.generated += 1
                self.tokens += 1
            worker.running.append(request)
        worker.prefilling.clear()
        done = [r for r in worker.running if r.generated >= r.output]
        for request in done:
            request.finished = self.now
            worker.running.remove(request)
            self._release(worker, request)
        self._start_step(worker)

    def _admission_blocks(self, request: Request) -> int:
        """Blocks a request is admitted with: its context so far plus the headroom, or its
        whole prompt and output when the policy reserves in full."""
        if self.policy.reserve_full:
            return -(-(request.prompt + request.output) // BLOCK_TOKENS)
        return -(-request.context // BLOCK_TOKENS) + HEADROOM_BLOCKS

    def _withdraw(self, worker: Worker) -> None:
        if worker.waiting is None:
            return
        if not self.ledger.cancel(worker.waiting_ticket):  # granted, not handed out yet
            worker.granted = worker.waiting
        del self._ticket_owner[worker.waiting_ticket]
        worker.waiting = None

    def _admit(self, worker: Worker) -> None:
        """Admit queue heads with their context's blocks plus headroom, in order, while the
        ledger grants them (a head that must wait parks at the ledger: that is demand)."""
        prefill = 0
        while worker.queue and len(worker.running) + len(worker.prefilling) < MAX_BATCH:
            if prefill and prefill + worker.queue[0].context > PREFILL_CHUNK:
                return
            if worker.granted is not None:  # charged by grants(); a preempted request may
                head = worker.granted  # have gone in front of it since
                worker.granted = None
                worker.queue.remove(head)
                blocks = self._admission_blocks(head)
            elif worker.waiting is not None:
                return  # still waiting
            else:
                head = worker.queue[0]
                blocks = self._admission_blocks(head)
                whole = -(-(head.prompt + head.output) // BLOCK_TOKENS) * worker.block_bytes
                if self.ledger.fit(worker.spec.name, whole).verdict == "never":
                    # The worker's HTTP 400 (issue 11): it could never finish within the
                    # model's limit; counted as a missed objective.
                    worker.queue.popleft()
                    continue
                ticket = next(self._tickets)
                verdict = self.ledger.request(
                    worker.spec.name, blocks * worker.block_bytes, ticket, math.inf, self.now
                )
                if verdict.outcome is Outcome.NEVER:
                    worker.queue.popleft()  # can never fit: refused (counted as missed)
                    continue
                if verdict.outcome is not Outcome.GRANT:
                    if verdict.queued:
                        worker.waiting = head
                        worker.waiting_ticket = ticket
                        self._ticket_owner[ticket] = (worker, head)
                    return
                worker.queue.popleft()
            head.held_blocks = blocks
            head.admitted_seq = next(self._admissions)
            worker.prefilling.append(head)
            prefill += head.context

    def _grow(self, worker: Worker) -> None:
        """Each decoding request whose next token needs a new block gets one, as the worker
        does: a growth asks the ledger ahead of its model's admissions and, while its model is
        owed it, waits until the step's growth deadline (the worker pauses: :attr:`Worker.
        growth`); a growth refused (or timed out: :meth:`_growth_timed_out`) preempts the
        newest request (itself, if it is the newest) and is tried again."""
        for request in sorted(worker.running, key=lambda r: r.admitted_seq):
            if request not in worker.running:
                continue  # preempted meanwhile
            while request.context + 1 > request.held_blocks * BLOCK_TOKENS:
                ticket = next(self._tickets)
                verdict = self.ledger.request(
                    worker.spec.name,
                    worker.block_bytes,
                    ticket,
                    worker.grow_deadline,
                    self.now,
                    growth=worker.index,
                )
                if verdict.outcome is Outcome.GRANT:
                    request.held_blocks += 1
                    continue
                if verdict.queued:
                    worker.growth = (request, ticket)
                    self._growth_owner[ticket] = worker
                    self._schedule(worker, worker.grow_deadline)
                    return
                if self._preempt_newest(worker) is request:
                    break

    def _preempt_newest(self, worker: Worker) -> Request:
        victim = max(worker.running, key=lambda r: r.admitted_seq)
        self._preempt(worker, victim)
        worker.step_preempted = True
        return victim

    def _growth_granted(self, worker: Worker) -> None:
        assert worker.growth is not None
        request, ticket = worker.growth
        worker.growth = None
        del self._growth_owner[ticket]
        request.held_blocks += 1
        worker.event = -1  # its deadline event is stale now
        self._continue_step(worker)

    def _growth_timed_out(self, worker: Worker) -> None:
        """The waiting growth's deadline passed (or its worker was asked to give bytes back,
        when the daemon answers the growth at once): the newest request gives way."""
        assert worker.growth is not None
        _, ticket = worker.growth
        if not self.ledger.cancel(ticket):
            return  # granted just now, not handed out yet: _after_change resumes the step
        worker.growth = None
        del self._growth_owner[ticket]
        self._preempt_newest(worker)
        worker.event = -1  # its deadline event is spent or stale
        self._continue_step(worker)

    def _preempt(self, worker: Worker, request: Request) -> None:
        worker.running.remove(request)
        self._release(worker, request)
        request.preemptions += 1
        worker.preemptions += 1
        worker.queue.appendleft(request)  # resumes first, recomputing its context

    def _release(self, worker: Worker, request: Request) -> None:
        if request.held_blocks:
            self.ledger.credit(worker.spec.name, request.held_blocks * worker.block_bytes)
            request.held_blocks = 0

    def _give_back(self, worker: Worker) -> None:
        """Answer the worker's reclaim ask: preempt newest requests until enough is freed."""
        ask = worker.ask
        assert ask is not None
        worker.ask = None
        freed = 0
        while freed < ask.n_bytes and (worker.running or worker.prefilling):
            if worker.prefilling:  # admitted this step, not computed yet: cheapest to give back
                request = worker.prefilling.pop()
                worker.queue.appendleft(request)
                freed += request.held_blocks * worker.block_bytes
                self._release(worker, request)
                continue
            victim = max(worker.running, key=lambda r: r.admitted_seq)
            freed += victim.held_blocks * worker.block_bytes
            self._preempt(worker, victim)
        held_now = self.ledger.held(worker.spec.name)
        answered, _ = self.book.answer(worker.index, ask.ask_id, freed, held_now, self.now)
        if answered is not None:
            self.latencies.append(self.now - answered.asked_at)

    # -- the daemon's side --------------------------------------------------------------------

    def _after_change(self) -> None:
        """What the daemon loop does after every change: hand out, then plan reclaims (and
        hand out what answering them let go)."""
        self._hand_out()
        if not self.policy.reclaim:
            return
        self.book.expire(self.now)
        holders = {w.spec.name: [(w.index, self.ledger.held(w.spec.name))] for w in self.workers}
        _, asks = plan_reclaim(
            self.ledger,
            self.book,
            lambda _models: holders,
            self.now,
            up_to_share=self.policy.reclaim_up_to_share,
        )
        for ask in asks:
            worker = self.workers[ask.sid]
            worker.ask = ask
            if worker.growth is not None:  # the daemon answers its waiting growth at once
                self._growth_timed_out(worker)
            elif worker.busy_until is None:  # idle: its next step boundary is now
                self._start_step(worker)
        self._hand_out()

    def _hand_out(self) -> None:
        while granted := self.ledger.grants():
            for ticket in granted:
                grower = self._growth_owner.get(ticket)
                if grower is not None:
                    self._growth_granted(grower)
                    continue
                owner = self._ticket_owner.pop(ticket, None)
                if owner is None:  # withdrawn after its grant: _withdraw took it as granted
                    continue
                worker, request = owner
                worker.waiting = None
                worker.granted = request
                if worker.busy_until is None:
                    self._start_step(worker)

    def _check(self) -> None:
        ledger = self.ledger
        ledger.check_invariants()
        assert ledger.total_held <= ledger.budget, "over the budget"
        for worker in self.workers:
            blocks = sum(r.held_blocks for r in worker.running + worker.prefilling)
            ticket_bytes = 0
            if worker.granted is not None:
                ticket_bytes = self._admission_blocks(worker.granted) * worker.block_bytes
            held = ledger.held(worker.spec.name)
            assert held == blocks * worker.block_bytes + ticket_bytes, (
                f"{worker.spec.name}: ledger {held} != requests' blocks"
            )
            settings = self.policy.settings.get(worker.spec.name)
            if settings is not None and settings.limit is not None:
                assert held <= settings.limit, f"{worker.spec.name} over its limit"
            for request in worker.queue:
                assert request.held_blocks == 0, "a queued request holds blocks"


def simulate(
    policy: Policy, trace: list[Request], check: bool = False, growth_wait: float = GROWTH_WAIT
) -> Result:
    return Simulation(policy, trace, check, growth_wait).run()


def capacity(policy: Policy, seed: int, duration: float, iterations: int) -> float:
    """The highest load multiplier meeting the attainment target (bisection on [0, 2]: at 2
    every policy is far past it with this trace)."""
    lo, hi = 0.0, 2.0
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if simulate(policy, make_trace(seed, duration, mid)).attainment() >= ATTAINMENT:
            lo = mid
        else:
            hi = mid
    return lo


def calibrate() -> None:
    """Measure the three cost constants with the built-in tiny llama (mlx, this machine)."""
    import time

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from vqpool.worker.models.tiny_models import build_tiny_model

    model, _ = build_tiny_model("llama")

    def timed(fn: object, repeat: int = 5) -> float:
        samples = []
        for _ in range(repeat):
            started = time.perf_counter()
            fn()  # type: ignore[operator]
            samples.append(time.perf_counter() - started)
        return statistics.median(samples)

    def prefill(n: int) -> None:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.zeros((1, n), dtype=mx.int32), cache=cache))

    per_token = (timed(lambda: prefill(1024)) - timed(lambda: prefill(16))) / (1024 - 16)

    def decode(batch: int) -> float:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.zeros((batch, 64), dtype=mx.int32), cache=cache))
        token = mx.zeros((batch, 1), dtype=mx.int32)
        return timed(lambda: mx.eval(model(token, cache=cache)), 20)

    one, sixteen = decode(1), decode(16)
    per_seq = (sixteen - one) / 15
    print(f"STEP_BASE = {one - per_seq:.3e}")
    print(f"DECODE_PER_SEQ = {per_seq:.3e}")
    print(f"PREFILL_PER_TOKEN = {per_token:.3e}")


def plot_attainment(path: str, policies: Sequence[Policy], seed: int, duration: float) -> None:
    """Draw the share of requests meeting the TTFT objective against the load, one line per
    policy, into a PNG at ``path`` (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    loads = [round(0.1 * i, 1) for i in range(1, 15)]
    fig, ax = plt.subplots(figsize=(7, 4))
    for policy in policies:
        shares = [simulate(policy, make_trace(seed, duration, load)).attainment() for load in loads]
        ax.plot(loads, shares, marker="o", markersize=3, label=policy.name)
    ax.axhline(ATTAINMENT, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("load (multiple of the trace's base rates)")
    ax.set_ylabel(f"share of requests with TTFT <= {TTFT_OBJECTIVE:g} s")
    ax.set_title(f"bench_elastic tier 1: seed {seed}, {duration:g} s trace, 16 MiB budget")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


def overload_variants(seed: int, duration: float, loads: Sequence[float]) -> None:
    """Which part of elastic costs what past capacity: elastic without reclaim, without
    lending, and reclaiming for reserves only, on the same overloaded traces."""
    elastic = elastic_policy()
    variants = (
        elastic,
        dataclasses.replace(elastic, name="lend, no reclaim", reclaim=False),
        dataclasses.replace(elastic, name="reserves, no lend", lend=False),
        dataclasses.replace(elastic, name="reclaim for reserves", reclaim_up_to_share=False),
        shared_policy(reserve_full=False),
    )
    print("overload: attainment, preemptions, reclaims answered/late, tokens generated")
    for load in loads:
        trace = make_trace(seed, duration, load)
        for policy in variants:
            r = simulate(policy, trace)
            print(
                f"  load {load:.1f}  {policy.name:<21} {r.attainment():.3f}  {r.preemptions:5d}  "
                f"{len(r.reclaim_latencies)}/{r.reclaims_late}  {r.tokens:,}"
            )


TIER2_BLOCK_BYTES = 4096
TIER2_BUDGET_BLOCKS = 256
TIER2_RESERVE_BLOCKS = 128
TIER2_BATCH = 16


def tier2_borrower(run_dir: str, seconds: float) -> None:
    """The simulated borrowing worker (a process of its own): steps of one calibrated decode
    sleep; at each boundary it answers a pending reclaim ask by preempting its newest requests,
    then admits requests of 8 blocks while the budget grants them (borrowing the idle reserve)."""
    import threading
    import time

    from vqpool.worker import PoolClient

    pending: list[int] = []
    asked = threading.Event()
    done = threading.Event()

    def on_reclaim(n_bytes: int, deadline: float) -> None:
        done.clear()
        pending.append(n_bytes)
        asked.set()
        done.wait(max(0.0, deadline - time.monotonic()))

    pool = PoolClient(run_dir, name="borrower", bytes_per_block=TIER2_BLOCK_BYTES)
    pool.set_reclaim_handler(on_reclaim)
    step = STEP_BASE + DECODE_PER_SEQ * TIER2_BATCH
    owners: list[str] = []
    serial = itertools.count()
    preemptions = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(step)  # one decode step of the batch
        if asked.is_set():
            asked.clear()
            want = pending.pop() if pending else 0
            freed = 0
            while freed < want and owners:
                pool.free_all(owners.pop())  # preempt the newest request
                freed += 8 * TIER2_BLOCK_BYTES
                preemptions += 1
            pool.report_load(len(owners), 0, preemptions)
            done.set()
            continue  # a step that preempted admits nothing
        while len(owners) < 64:
            owner = f"r{next(serial)}"
            try:
                pool.allocate("k", 8 * BLOCK_TOKENS, owner)
            except Exception:
                break
            owners.append(owner)
    pool.close()


def tier2(rounds: int) -> None:
    """Tier 2: real daemon, a simulated borrower process, a reserve asked back ``rounds``
    times; prints the reclaim latency and the owner's wait against one decode step."""
    import os
    import subprocess
    import tempfile
    import time
    from pathlib import Path

    from vqpool.shared.admin_client import AdminClient
    from vqpool.worker import PoolClient
    from vqpool.worker.testing.launch import DaemonProcess

    step = STEP_BASE + DECODE_PER_SEQ * TIER2_BATCH
    with tempfile.TemporaryDirectory(prefix="vqel") as base:
        run_dir = Path(base) / "run"
        budget = TIER2_BUDGET_BLOCKS * TIER2_BLOCK_BYTES
        daemon = DaemonProcess(
            run_dir, "--budget", str(budget), "--lend-reserves", "--log-level", "WARNING"
        ).start()
        borrower = None
        try:
            admin = AdminClient(run_dir, timeout=5.0)
            reserve = TIER2_RESERVE_BLOCKS * TIER2_BLOCK_BYTES
            admin.call("model_set", model="owner", reserve=reserve, create=True)
            seconds = rounds * 0.25 + 30  # ended as soon as the rounds are done
            borrower = subprocess.Popen(
                [
                    sys.executable,
                    os.path.abspath(__file__),
                    *("--tier2-borrower", str(run_dir), "--tier2-seconds", str(seconds)),
                ]
            )
            owner = PoolClient(run_dir, name="owner", bytes_per_block=TIER2_BLOCK_BYTES)
            time.sleep(1.0)  # the borrower fills the pool, most of it on loan
            waits = []
            for i in range(rounds):
                started = time.perf_counter()
                owner.allocate("k", 32 * BLOCK_TOKENS, f"a{i}", "fp16", wait=5.0)
                waits.append(time.perf_counter() - started)
                time.sleep(0.1)
                owner.free_all(f"a{i}")
                time.sleep(0.1)  # the borrower borrows the reserve back meanwhile
            view = admin.call("budget")["reclaim"]
            owner.close()
        finally:
            if borrower is not None:
                borrower.terminate()
                borrower.wait(timeout=30)
            daemon.stop()
    waits.sort()
    p50, p99 = waits[len(waits) // 2], waits[min(len(waits) - 1, int(0.99 * len(waits)))]
    print(
        f"tier 2 (real vqpoold, simulated borrower, decode step {step * 1000:.2f} ms, "
        f"{rounds} rounds):"
    )
    print(
        f"  reclaims asked {view['asked']}, answered {view['answered']}, late {view['late']}, "
        f"given back {view['bytes_reclaimed'] // 1024} KiB, preemptions {view['preemptions']}"
    )
    if view["latency_p50_s"] is not None:
        print(
            f"  reclaim latency (daemon, ask to answer): p50 {view['latency_p50_s'] * 1000:.1f} ms"
            f" p99 {view['latency_p99_s'] * 1000:.1f} ms (target p99 <= "
            f"{(step + 0.020) * 1000:.1f} ms: one decode step + 20 ms)"
        )
    print(
        f"  owner's allocate wait for its reserve: p50 {p50 * 1000:.1f} ms p99 "
        f"{p99 * 1000:.1f} ms (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)"
    )


def tier3_run(
    seed: int, duration: float, load: float, policies: Sequence[str] | None, rounds: int
) -> None:
    """Tier 3: the tier-1 trace, shortened and scaled to the built-in tiny llama."""
    import os

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_elastic_tier3 import LENGTH_SCALE, POLICIES, tier3

    trace = make_trace(seed, duration, load)
    for request in trace:
        request.prompt = max(1, request.prompt // LENGTH_SCALE)
        request.output = max(1, request.output // LENGTH_SCALE)
    names = [s.name for s in MODELS]
    tier3(trace, names, BUDGET // 2048 // LENGTH_SCALE, RESERVES, policies or POLICIES, rounds)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of every figure")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--calibrate", action="store_true", help="measure the cost constants")
    parser.add_argument("--tier2", action="store_true", help="run tier 2 only")
    parser.add_argument(
        "--tier3", action="store_true", help="run tier 3 only (real workers, built-in models)"
    )
    parser.add_argument("--tier3-seconds", type=float, default=30.0, help="tier 3 trace length")
    parser.add_argument("--tier3-load", type=float, default=1.0, help="tier 3 load multiplier")
    parser.add_argument(
        "--tier3-rounds", type=int, default=1, help="tier 3 plays per policy (alternating)"
    )
    parser.add_argument(
        "--tier3-policies",
        help="tier 3 policies, comma-separated (default: elastic, elastic full, shared today; "
        "also: elastic auto)",
    )
    parser.add_argument("--plot", metavar="PNG", help="also draw attainment against load")
    parser.add_argument(
        "--overload", action="store_true", help="run only the overload variants of elastic"
    )
    parser.add_argument("--tier2-borrower", metavar="RUN_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--tier2-seconds", type=float, default=30.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.calibrate:
        calibrate()
        return 0
    if args.tier2_borrower:
        tier2_borrower(args.tier2_borrower, args.tier2_seconds)
        return 0
    if args.tier2:
        tier2(10 if args.quick else 100)
        return 0
    if args.tier3:
        policies = args.tier3_policies.split(",") if args.tier3_policies else None
        seconds = 8.0 if args.quick else args.tier3_seconds
        tier3_run(args.seed, seconds, args.tier3_load, policies, args.tier3_rounds)
        return 0
    if args.overload:
        overload_variants(args.seed, 24.0 if args.quick else 120.0, (1.2, 1.4))
        return 0
    duration, iterations, grid = (24.0, 4, 4) if args.quick else (120.0, 7, 8)
    seed = args.seed
    print(
        f"tier 1 (simulated, virtual clock): seed {seed}, {duration:g} s trace, budget "
        f"{BUDGET // 2**20} MiB, TTFT objective {TTFT_OBJECTIVE:g} s at {ATTAINMENT:.0%}"
    )
    elastic = elastic_policy()
    shared = shared_policy()
    grown = shared_policy(reserve_full=False)
    statics = [static_policy(split) for split in static_splits(grid)]
    caps = {
        p.name: capacity(p, seed, duration, iterations) for p in (elastic, shared, grown, *statics)
    }
    best_static = max(statics, key=lambda p: caps[p.name])
    print(f"capacity (load multiplier at {ATTAINMENT:.0%} TTFT <= {TTFT_OBJECTIVE:g} s):")
    for policy in (elastic, best_static, shared, grown):
        print(f"  {policy.name:<16} {caps[policy.name]:.3f}")
    ratio = caps[elastic.name] / caps[best_static.name] if caps[best_static.name] else math.inf
    print(f"  elastic / best static: {ratio:.2f}x (target >= 1.5x)")
    load = caps[elastic.name] or 1.0
    trace = make_trace(seed, duration, load)
    results = {p.name: simulate(p, trace) for p in (elastic, best_static, shared, grown)}
    print(f"at the elastic capacity (load {load:.3f}, {len(trace)} requests):")
    header = "  ".join(f"{s.name:>9}" for s in MODELS)
    print(f"  p99 TTFT (s)      {header}")
    for name, result in results.items():
        row = "  ".join(f"{result.p99_ttft(i):9.3f}" for i in range(len(MODELS)))
        print(f"  {name:<16}  {row}   attainment {result.attainment():.3f}")
    bursty = MODELS.index(next(s for s in MODELS if s.burst_on))
    gain = results[shared.name].p99_ttft(bursty) / max(results[elastic.name].p99_ttft(bursty), 1e-9)
    print(f"  bursty p99 TTFT, shared / elastic: {gain:.2f}x (target >= 2x)")
    er = results[elastic.name]
    below = ", ".join(f"{k} {v:.2%}" for k, v in er.below_reserve_with_demand.items())
    print(f"  elastic: time below reserve with waiting demand: {below} (target <= 1%)")
    if er.reclaim_latencies:
        lat = sorted(er.reclaim_latencies)
        p50 = lat[len(lat) // 2]
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        print(
            f"  elastic: reclaims {len(lat)} answered, {er.reclaims_late} late, latency p50 "
            f"{p50 * 1000:.1f} ms p99 {p99 * 1000:.1f} ms (virtual: one step); preemptions "
            f"{er.preemptions}"
        )
    else:
        print(f"  elastic: no reclaim was needed; preemptions {er.preemptions}")
    overload = 2 * max(max(caps.values()), 0.25)
    steady = make_trace(seed, duration, overload, steady_only=True)
    tput = {p.name: simulate(p, steady) for p in (elastic, best_static)}
    rates = {name: r.tokens / r.duration for name, r in tput.items()}
    print(
        f"throughput under steady overload (load {overload:.3f}): "
        + ", ".join(f"{n} {v:,.0f} tok/s" for n, v in rates.items())
        + f"; elastic / best static {rates[elastic.name] / rates[best_static.name]:.3f} "
        "(target >= 0.95)"
    )
    if args.plot:
        plot_attainment(args.plot, (elastic, best_static, shared, grown), seed, duration)
    tier2(10 if args.quick else 100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
