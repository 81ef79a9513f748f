"""Which models are loaded: started on demand, one worker per model whatever the concurrency,
unloaded when idle, and never while a request runs on them or waits for them.

Every decision runs on the event loop's one thread between awaits, so a check and what it
leads to are one step: a request that finds its model loaded is counted before anything else
can look, and an idle timer that fires finds the model busy again if a request came first.

- A request for a model that is not loaded queues on it (at most ``max_queue``, at most
  ``timeout`` seconds) and the first one starts its load; the others wait for the same load.
- A load needs room under ``max_loaded`` (an extra cap; none by default): the least recently
  used idle model that is not pinned is unloaded for it, one at a time; while none is idle, the
  load waits (it never preempts). Loads waiting for room start in the order their first request
  came.
- A load is an allocation: before its worker starts it asks vqpoold's ledger for the model's
  weights, its worker's overhead (the MLX buffer-cache limit it gets) and its KV minimum
  (``load_reserve``; the worker's hello takes the reservation over).
  When bytes are short they are freed in one order, re-asking after each step: the prompt
  caches the daemon asked to release, then an idle model that is not pinned and was loaded at
  least ``min_residency`` seconds, of those that cover what is short one not mid-conversation
  first, then the least asked for (:meth:`Supervisor._memory_victim`; a model mid-conversation
  is spared for as long as its reload would take while another may go idle instead,
  :meth:`Supervisor._spared`; its exit and its session's end verified first, and the bytes it
  frees go to that load first); then the load waits for a change. A load that can
  never fit is refused at once: every request waiting for it gets a 400 naming the numbers.
- When the daemon shows more held than its budget (lowered live), or a loaded model's requests
  waiting for KV the loaded weights leave no room for, idle models are unloaded in the same order.
- A failed load answers every request waiting for it with the worker's reason; the next
  request tries again, after a backoff once failures repeat (:class:`ModelSlot`).
- Idle is no running and no queued request; ``keep_alive`` counts from the last request's end.
- An unload is SIGTERM to the worker, its exit, and its session gone from vqpoold (its blocks
  back) before the model counts as not loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Any

from vqpool.daemon.front.catalog import Catalog, ModelEntry
from vqpool.daemon.front.errors import bad_gateway, bad_request, overloaded
from vqpool.daemon.front.ledger_calls import DEFAULT_LOAD_KV_TOKENS, LedgerCalls
from vqpool.daemon.front.load_wait import LoadWait
from vqpool.daemon.front.metrics import FrontMetrics
from vqpool.daemon.front.model_slot import (
    LOADED,
    LOADING,
    NOT_LOADED,
    UNLOADING,
    WAITING_FOR_MEMORY,
    ModelSlot,
)
from vqpool.daemon.front.worker_process import WorkerProcess, WorkerStartError
from vqpool.shared.admin_client import AdminClient
from vqpool.shared.byte_sizes import format_bytes, parse_bytes
from vqpool.shared.errors import UnknownOpError, VqpoolError
from vqpool.shared.model_weights import (
    ADAPTER_WEIGHTS,
    WeightsEstimate,
    estimate_weights,
    safetensors_tensor_bytes,
    serve_cache_limit,
    worker_overhead,
)

log = logging.getLogger("vqpool.serve")

SESSION_GONE_TIMEOUT = 15.0
"""Seconds an unloaded worker's session may take to leave vqpoold (its goodbye is immediate;
a worker that had to be killed is noticed by the daemon's peer check within its lease)."""
DEFAULT_SWAP_GRACE = 0.5
"""Seconds a model that just served stays safe from being unloaded for another's load."""
EXIT_REASON_WAIT = 2.0
"""Seconds a failed proxied request waits for its worker's exit, to name the crash."""
DEFAULT_MIN_RESIDENCY = 5.0
"""Seconds a model stays loaded at least before a load short of bytes may unload it."""
DEFAULT_CONVERSATION_GAP = 10.0
"""Seconds after its last request during which a model counts as mid-conversation: its chat's
next turn is likely to come soon (a person's reply, an agent's next step), and unloaded now it
would be reloaded for it (scripts/bench_models.py measured such reloads in the slowest
requests)."""
MEMORY_RECHECK = 1.0
"""Seconds between two asks of a load waiting for memory, and between two looks at the budget
for a live change (bytes also come back where the front door does not see it: another
model's KV, a budget raised)."""


def _weights_or_none(entry: ModelEntry) -> WeightsEstimate | None:
    """What ``entry``'s worker will hold in parameters: its model's weights, and its draft
    model's and LoRA adapters' (which load beside them); None when the files cannot tell."""
    try:
        found = estimate_weights(entry.path)
        if found is None:
            return None
        extra = 0
        draft = entry.worker_option("--draft-model")
        if draft is not None:
            draft_weights = estimate_weights(draft)
            if draft_weights is None:
                return None
            extra += draft_weights.nbytes
        adapters = entry.worker_option("--adapter-path")
        if adapters is not None:
            file = Path(adapters).expanduser() / ADAPTER_WEIGHTS
            extra += sum(safetensors_tensor_bytes(file).values())
        return replace(found, nbytes=found.nbytes + extra)
    except (ValueError, OSError) as exc:
        log.warning("%s: weights unknown: %s", entry.path, exc)
        return None


def _cache_limit(entry: ModelEntry, weights: WeightsEstimate | None) -> int:
    """The MLX buffer-cache limit of ``entry``'s worker: its table's ``mlx_cache_limit``, else
    :func:`serve_cache_limit` of its weights (a bad value fails the worker's start, which
    names it; the default stands in until then)."""
    given = entry.worker_option("--mlx-cache-limit")
    if given is not None:
        with contextlib.suppress(ValueError):
            return parse_bytes(given, what="mlx_cache_limit", allow_zero=True)
    return serve_cache_limit(None if weights is None else weights.nbytes)


def fixed_bytes(totals: dict[str, Any]) -> int:
    """The bytes the ledger charges beside KV (a ``budget`` answer): the loaded models'
    weights and their workers' overhead."""
    return int(totals["total_weights"]) + int(totals.get("total_overhead", 0))


def kv_blocked_by_weights(totals: dict[str, Any], models: list[dict[str, Any]]) -> int:
    """KV bytes the models' requests wait for at vqpoold that could not be granted even if every
    other model gave back all the KV it holds: more than the budget leaves beside the loaded
    models' weights and the other models' reserves (``budget`` and ``model_list`` answers).
    Only an unload makes room for those; a greedy model's requests that other models' KV holds
    back wait for it (the ledger's fair shares and reclaim), and unload no one."""
    room = totals["budget"] - fixed_bytes(totals)
    reserved = sum(row["reserve"] for row in models)
    return max(
        (
            row["waiting_bytes"] - (room - (reserved - row["reserve"]))
            for row in models
            if row["waiting_bytes"]
        ),
        default=0,
    )


class Supervisor:
    """The served models' workers (see the module docstring).

    Args:
        catalog: The models served.
        run_dir: vqpoold's run directory (workers join its pool; their logs go under it).
        max_loaded: The most models loaded at once (None: no cap).
        max_queue: The most requests waiting for one model to load.
        load_timeout: Seconds a worker may take to serve once started.
        swap_grace: Seconds after its last request before a model may be unloaded to make
            room for another.
        min_residency: Seconds a model stays loaded at least before a load short of bytes may
            unload it.
        conversation_gap: Seconds after its last request during which a model counts as
            mid-conversation: it is unloaded for bytes only when no other idle model makes
            room.
        load_kv_tokens: Tokens of KV a load asks room for beside its weights (unless the
            model's reserve is larger).
        metrics: Where loads, unloads and waits are counted.
    """

    def __init__(
        self,
        catalog: Catalog,
        run_dir: Path,
        *,
        max_loaded: int | None,
        max_queue: int,
        load_timeout: float,
        swap_grace: float = DEFAULT_SWAP_GRACE,
        min_residency: float = DEFAULT_MIN_RESIDENCY,
        conversation_gap: float = DEFAULT_CONVERSATION_GAP,
        load_kv_tokens: int = DEFAULT_LOAD_KV_TOKENS,
        metrics: FrontMetrics,
    ) -> None:
        self.catalog = catalog
        self.run_dir = run_dir
        self.max_loaded = max_loaded
        self.max_queue = max_queue
        self.load_timeout = load_timeout
        self.swap_grace = swap_grace
        self.min_residency = min_residency
        self.conversation_gap = conversation_gap
        self.load_kv_tokens = load_kv_tokens
        self.ledger = LedgerCalls(run_dir)
        self._grace_timer: asyncio.TimerHandle | None = None
        self.metrics = metrics
        self.slots = {name: ModelSlot(entry) for name, entry in catalog.entries.items()}
        self._changed: asyncio.Future[None] | None = None
        self._freed_for: ModelSlot | None = None
        """The load an unload under way (or just done) frees bytes for: until it asks again,
        no other load asks (:meth:`_reserve`)."""
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        metrics.watch(self.slots)

    # -- requests ----------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lease(
        self, slot: ModelSlot, keep_alive: float | None, timeout: float
    ) -> AsyncIterator[tuple[WorkerProcess, LoadWait]]:
        """The model's worker for one request, loading the model first if needed, and what the
        request waited for that; the request counts as running until the block ends.
        ``keep_alive`` (seconds) replaces the model's for the idle time after it.

        Raises:
            ApiError: 503 when the wait for the load outlasts ``timeout`` or the queue is
                full, 502 when the load fails.
        """
        admitted = await self._admit(slot, timeout)
        try:
            yield admitted
        finally:
            self._release(slot, keep_alive)

    async def _admit(self, slot: ModelSlot, timeout: float) -> tuple[WorkerProcess, LoadWait]:
        if self._closing:
            raise overloaded("the server is shutting down")
        slot.note_request(asyncio.get_running_loop().time())
        if slot.state == LOADED and slot.worker is not None:
            slot.running += 1
            self._touch(slot)
            return slot.worker, LoadWait()
        if slot.queued >= self.max_queue:
            raise overloaded(f"{slot.queued} requests already wait for {slot.name} to load")
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + timeout
        answers_seen = slot.answers
        refusals_seen = slot.refusals
        if slot.queued == 0:
            slot.waiting_since = started
        slot.queued += 1
        self._touch(slot)
        try:
            while True:
                if self._closing:
                    raise overloaded("the server is shutting down")
                if slot.state == LOADED and slot.worker is not None:
                    break
                if slot.refusals != refusals_seen:
                    raise bad_request(slot.last_error)
                if slot.answers != answers_seen:
                    raise bad_gateway(slot.last_error)
                now = loop.time()
                if slot.state == NOT_LOADED and slot.retry_at > now:
                    wait = slot.retry_at - now
                    raise bad_gateway(
                        f"{slot.last_error} (loads of {slot.name} keep failing: the next try "
                        f"in {wait:.0f} s)",
                        retry_after=wait,
                    )
                self._schedule()
                if deadline <= now:
                    raise overloaded(
                        f"{slot.name} is still {self._why_waiting(slot)} after {timeout:g} s "
                        "(--queue-timeout)"
                    )
                await self._wait_for_change(deadline - now)
            slot.running += 1
            waited = loop.time() - started
            self.metrics.queue_wait(slot.name, waited)
            return slot.worker, LoadWait.split(
                waited, slot.last_load_seconds or 0.0, slot.residency_wait
            )
        finally:
            slot.queued -= 1
            if slot.answers != answers_seen and slot.answered > 0:
                slot.answered -= 1
            self._touch(slot)
            self._settle(slot)
            self._notify()

    def _why_waiting(self, slot: ModelSlot) -> str:
        if slot.state == NOT_LOADED:
            return f"waiting for room to load (at most {self.max_loaded} models loaded at once)"
        if slot.state == WAITING_FOR_MEMORY and slot.memory_wait:
            return f"waiting for memory ({slot.memory_wait})"
        return slot.state

    def _release(self, slot: ModelSlot, keep_alive: float | None) -> None:
        slot.running -= 1
        slot.last_used = asyncio.get_running_loop().time()
        slot.last_used_wall = time.time()
        slot.keep_alive = slot.entry.keep_alive if keep_alive is None else keep_alive
        self._touch(slot)
        self._settle(slot)
        self._notify()

    def _touch(self, slot: ModelSlot) -> None:
        """A request started, ended or started waiting: the idle timer no longer holds."""
        slot.activity += 1
        if slot.idle_timer is not None:
            slot.idle_timer.cancel()
            slot.idle_timer = None

    # -- idle --------------------------------------------------------------------------------------

    def _settle(self, slot: ModelSlot) -> None:
        """When ``slot`` just became idle: unload it now, or when its keep-alive runs out."""
        if not slot.idle or self._closing:
            return
        if slot.unload_when_idle:
            self._start_unload(slot, "operator")
        elif slot.entry.pinned or slot.keep_alive == math.inf:
            return
        elif slot.keep_alive <= 0:
            self._start_unload(slot, "idle")
        else:
            slot.idle_timer = asyncio.get_running_loop().call_later(
                slot.keep_alive, self._idle_expired, slot, slot.activity
            )

    def _idle_expired(self, slot: ModelSlot, activity: int) -> None:
        slot.idle_timer = None
        if slot.activity == activity and slot.idle and not self._closing:
            self._start_unload(slot, "idle")

    # -- placement ---------------------------------------------------------------------------------

    def _has_room(self) -> bool:
        if self.max_loaded is None:
            return True
        return sum(s.holds_room for s in self.slots.values()) < self.max_loaded

    def _schedule(self) -> None:
        """Start the loads that have room, oldest wait first; free room for the next one."""
        if self._closing:
            return
        now = asyncio.get_running_loop().time()
        pending = [
            s
            for s in self.slots.values()
            if s.state == NOT_LOADED and s.queued > s.answered and s.retry_at <= now
        ]
        pending.sort(key=lambda s: s.waiting_since)
        for slot in pending:
            if not self._has_room():
                self._free_room()
                return
            slot.state = WAITING_FOR_MEMORY
            self._start(self._load(slot))

    def _free_room(self) -> None:
        """Unload the least recently used idle, unpinned model, unless one is unloading or
        its last request ended less than ``swap_grace`` ago (then try again when it has)."""
        if any(s.state == UNLOADING for s in self.slots.values()):
            return
        victims = [s for s in self.slots.values() if s.evictable]
        if not victims:
            return
        victim = min(victims, key=lambda s: s.last_used or 0.0)
        loop = asyncio.get_running_loop()
        # NOTE: requests sent together (an editor's two models) arrive in any order; a model
        # just used is likely asked again at once, so it is not swapped out within the grace.
        wait = (victim.last_used or 0.0) + self.swap_grace - loop.time()
        if wait > 0:
            if self._grace_timer is None:
                self._grace_timer = loop.call_later(wait, self._grace_over)
            return
        self._start_unload(victim, "room")

    def _grace_over(self) -> None:
        self._grace_timer = None
        self._schedule()

    # -- loads and unloads -------------------------------------------------------------------------

    async def _load(self, slot: ModelSlot) -> None:
        loop = asyncio.get_running_loop()
        try:
            go, ticket = await self._reserve(slot)
        except VqpoolError as exc:
            self._load_failed(slot, f"vqpoold did not reserve memory for {slot.name}: {exc}")
            return
        slot.memory_wait = ""
        if not go:
            slot.state = NOT_LOADED
            self._notify()
            return
        slot.state = LOADING
        worker = WorkerProcess(slot.entry, self.run_dir, slot.cache_limit)
        slot.worker = worker
        started = loop.time()
        log.info("loading %s (%s)", slot.name, slot.entry.path)
        try:
            await worker.start(self.load_timeout)
        except WorkerStartError as exc:
            slot.worker = None
            if ticket is not None:  # its worker never said hello: the bytes go back now
                with contextlib.suppress(VqpoolError):
                    await self.ledger.release(ticket)
            self._load_failed(slot, str(exc))
            return
        except asyncio.CancelledError:  # shutting down mid-load (the ticket's ttl frees it)
            await worker.stop()
            raise
        slot.state = LOADED
        slot.loads += 1
        slot.loaded_at = loop.time()
        slot.loaded_at_wall = time.time()
        slot.last_load_seconds = slot.loaded_at - started
        slot.last_used = slot.loaded_at  # an idle model's LRU age counts from its load at least
        self.metrics.loaded(slot.name, slot.last_load_seconds)
        log.info(
            "loaded %s in %.2f s: pid %s on %s",
            slot.name,
            slot.last_load_seconds,
            worker.pid,
            worker.url,
        )
        self._start(self._watch(slot, worker))
        self._settle(slot)
        self._notify()

    def _load_failed(self, slot: ModelSlot, reason: str) -> None:
        slot.state = NOT_LOADED
        slot.load_failures += 1
        slot.record_failure(reason, asyncio.get_running_loop().time())
        self.metrics.load_failed(slot.name)
        log.warning("loading %s failed: %s", slot.name, reason)
        self._notify()

    async def _reserve(self, slot: ModelSlot) -> tuple[bool, str | None]:
        """Reserve the load's bytes at the ledger, freeing them in order while short (see the
        module docstring): whether to start the worker, and the ticket its hello takes over
        (None from a vqpoold without load reservations). Not to start: nobody waits for it any
        more, or it can never fit (its waiters are answered).

        Raises:
            VqpoolError: vqpoold does not answer.
        """
        try:
            return await self._reserve_freeing(slot)
        finally:
            if self._freed_for is slot:
                self._freed_for = None

    async def _reserve_freeing(self, slot: ModelSlot) -> tuple[bool, str | None]:
        weights = None if slot.weights is None else slot.weights.nbytes
        need = await self.ledger.need(
            slot.name,
            slot.entry.path,
            weights,
            self.load_kv_tokens,
            worker_overhead(slot.cache_limit),
            slot.entry.kv_quantization(),
            slot.entry.sequence_quantization(),
        )
        slot.residency_wait = 0.0
        loop = asyncio.get_running_loop()
        began = loop.time()
        while True:
            if self._closing or slot.queued <= slot.answered:
                return False, None
            claimant = self._freed_for
            if claimant not in (None, slot) and claimant.state == WAITING_FOR_MEMORY:
                # Bytes an unload just freed go to the load it was for: asked first, another
                # load would take them and leave that one short again.
                await self._wait_for_change(MEMORY_RECHECK)
                continue
            try:
                ticket, short = await self.ledger.reserve(slot.name, need, self.load_timeout)
            except UnknownOpError:
                log.warning("vqpoold does not reserve memory for loads (an older one): loading")
                return True, None
            except ValueError as exc:  # it can never fit: no wait helps
                reason = str(exc).removeprefix("load_reserve: ")
                slot.refuse(reason)
                log.warning("not loading %s: %s", slot.name, reason)
                return False, None
            if self._freed_for is slot:  # it asked: the bytes freed for it are its or gone
                self._freed_for = None
            if short is None:
                if ticket is not None and (self._closing or slot.queued <= slot.answered):
                    await self.ledger.release(ticket)  # its requests left while it asked
                    return False, None
                return True, ticket
            slot.memory_wait = short.message(slot.name)
            # Caches first, when they cover what is short: the daemon has asked for them.
            # NOTE: only then. Chats that go on refill their caches, so waiting for caches that
            # cannot cover it would keep a load draining them piecemeal instead of unloading.
            if short.cached >= short.short:
                await self.ledger.cache_released()
                continue
            frees = await self._unload_frees()
            spared = self._spared(loop.time() - began)
            victim = self._memory_victim(short.short, frees, spared=spared)
            if victim is not None:
                log.info(
                    "unloading idle %s to load %s (%s)", victim.name, slot.name, slot.memory_wait
                )
                self._start_unload(victim, "memory")
                self._freed_for = slot
                while victim.state == UNLOADING:
                    await self._wait_for_change(MEMORY_RECHECK)
                continue
            if short.cached > 0:
                await self.ledger.cache_released()
                continue
            held_by_residency = self._memory_victim(
                short.short, frees, min_residency=0.0, spared=spared
            )
            waited_from = loop.time()
            await self._wait_for_change(MEMORY_RECHECK)
            if held_by_residency is not None:
                slot.residency_wait += loop.time() - waited_from

    def _memory_victim(
        self,
        short: int = 0,
        frees: dict[str, int] | None = None,
        min_residency: float | None = None,
        spared: frozenset[str] = frozenset(),
    ) -> ModelSlot | None:
        """The model to unload for bytes: an idle one, not pinned, loaded at least
        ``min_residency`` seconds; of those whose unload alone frees ``short`` bytes if any
        does, else of all, one not mid-conversation (its last request ended at least
        ``conversation_gap`` seconds ago) before one that is, then the least asked for
        (:attr:`ModelSlot.demand`), then the least recently used. None while another unload
        is under way (one at a time, each verified before the next), or when unloading every
        one of them would still leave ``short`` uncovered (then an unload frees nothing the
        load can use now: the model unloaded is likely asked again, and its reload takes the
        bytes back while the load waits on). ``frees``: what each model's unload frees
        (:meth:`_unload_frees`); a model it does not name counts as freeing enough.
        ``min_residency``: the residency to respect (None: ``--min-residency``); ``spared``:
        models not to unload now (:meth:`_spared`)."""
        if any(s.state == UNLOADING for s in self.slots.values()):
            return None
        if min_residency is None:
            min_residency = self.min_residency
        now = asyncio.get_running_loop().time()
        # NOTE: by demand, not recency alone: a hot model idle between two bursts is the least
        # recently used for a moment, and its unload costs a reload under its next burst.
        # NOTE: a model mid-conversation goes last: unloaded while its chat thinks, it is asked
        # again within seconds, and its reload is among the slowest waits of all.
        victims = sorted(
            (
                s
                for s in self.slots.values()
                if s.evictable_for_memory(now, min_residency) and s.name not in spared
            ),
            key=lambda s: (
                s.in_conversation(now, self.conversation_gap),
                round(s.demand_now(now), 1),
                s.last_used or 0.0,
            ),
        )
        freed = {s.name: (frees or {}).get(s.name, math.inf) for s in victims}
        covering = [s for s in victims if freed[s.name] >= short]
        if covering:
            return covering[0]
        if victims and sum(freed.values()) >= short:
            return victims[0]
        return None

    def _spared(self, waited: float) -> frozenset[str]:
        """The idle models a load that has waited ``waited`` seconds for memory leaves loaded
        for now: each one mid-conversation whose reload would take longer than that (its last
        load's seconds), while another model is loaded or loading that may become idle and go
        instead (running or queued requests, loading, or inside its residency). Unloaded, a
        model mid-conversation is asked again within seconds and its chat waits for its
        reload; the load waiting at most that long instead is no slower at the tail, and the
        wait often ends sooner, when the other model goes idle. With no such other model,
        nothing is spared (two models swapped by one user: the load goes at once)."""
        now = asyncio.get_running_loop().time()
        idle_in_conversation = [
            s
            for s in self.slots.values()
            if s.evictable and s.in_conversation(now, self.conversation_gap)
        ]
        others = [
            s
            for s in self.slots.values()
            if not s.entry.pinned
            and (
                s.state == LOADING
                or (s.state == LOADED and not s.idle)
                or (s.idle and not s.evictable_for_memory(now, self.min_residency))
            )
        ]
        if not others:
            return frozenset()
        return frozenset(
            s.name for s in idle_in_conversation if (s.last_load_seconds or 0.0) > waited
        )

    async def _unload_frees(self) -> dict[str, int] | None:
        """What unloading each model frees at vqpoold: its weights, its workers' overhead and
        the KV it holds; None when vqpoold does not say."""
        try:
            rows = (await self.ledger.call("model_list"))["models"]
        except VqpoolError:
            return None
        return {r["model"]: r["weights"] + r.get("overhead", 0) + r["held"] for r in rows}

    async def _watch_budget(self) -> None:
        """Unload idle models while vqpoold holds more than its budget (lowered live), or a
        loaded model's requests wait for KV that the loaded weights leave no room for
        (:func:`kv_blocked_by_weights`), and the prompt caches cannot cover it (the daemon takes
        those back first): bytes are freed in the same order as for a load."""
        while True:
            await asyncio.sleep(MEMORY_RECHECK)
            try:
                listing = await self.ledger.call("model_list")
                totals = listing["budget"]
                if totals["budget"] is None:
                    continue
                excess = totals["total_held"] + fixed_bytes(totals) - totals["budget"]
                blocked = kv_blocked_by_weights(totals, listing["models"])
                if excess <= 0 and blocked <= 0:
                    continue
                cached = 0
                if excess > 0:  # KV given back covers an excess, not room the weights take
                    sessions = await self.ledger.call("sessions")
                    cached = sum((s.get("prompt_cache") or {}).get("bytes", 0) for s in sessions)
            except VqpoolError as exc:
                log.debug("could not read vqpoold's budget: %s", exc)
                continue
            victim = self._memory_victim() if excess > cached or blocked > 0 else None
            if victim is not None:
                if excess > cached:
                    why, reason = f"{format_bytes(excess)} over its budget", "budget"
                else:
                    why = f"{format_bytes(blocked)} short of KV beside the weights"
                    reason = "memory"
                log.info("vqpoold is %s: unloading idle %s", why, victim.name)
                self._start_unload(victim, reason)

    async def _watch(self, slot: ModelSlot, worker: WorkerProcess) -> None:
        """A worker that exits while its model counts as loaded crashed: the next request
        starts another."""
        status = await worker.wait()
        if slot.worker is not worker or slot.state != LOADED:
            return  # an unload stopped it
        reason = worker.exit_reason(status)
        slot.state = NOT_LOADED
        slot.worker = None
        slot.crashes += 1
        slot.unloaded_at_wall = time.time()
        slot.record_failure(reason, asyncio.get_running_loop().time())
        self._touch(slot)
        self.metrics.crashed(slot.name)
        log.warning("%s (%d running requests failed)", reason, slot.running)
        self._notify()

    def _start_unload(self, slot: ModelSlot, reason: str) -> None:
        slot.state = UNLOADING
        self._touch(slot)
        self._start(self._unload(slot, reason))

    async def _unload(self, slot: ModelSlot, reason: str) -> None:
        worker = slot.worker
        assert worker is not None
        log.info("unloading %s (%s): pid %s", slot.name, reason, worker.pid)
        status = await worker.stop()
        if worker.pid is not None:
            await self._session_gone(worker.pid)
        slot.state = NOT_LOADED
        slot.worker = None
        slot.unload_when_idle = False
        slot.keep_alive = slot.entry.keep_alive
        slot.unloads[reason] = slot.unloads.get(reason, 0) + 1
        slot.unloaded_at_wall = time.time()
        self.metrics.unloaded(slot.name, reason)
        log.info("unloaded %s (exit status %s)", slot.name, status)
        self._notify()

    async def _session_gone(self, pid: int) -> None:
        """Wait until vqpoold holds no session of process ``pid`` (its blocks are back)."""

        def poll() -> bool:
            deadline = time.monotonic() + SESSION_GONE_TIMEOUT
            with AdminClient(self.run_dir, timeout=2.0) as admin:
                while time.monotonic() < deadline:
                    sessions = admin.call("sessions")
                    if not any(s["pid"] == pid for s in sessions):
                        return True
                    time.sleep(0.05)
            return False

        try:
            gone = await asyncio.to_thread(poll)
        except VqpoolError as exc:
            log.warning("could not check that pid %d's session left vqpoold: %s", pid, exc)
            return
        if not gone:
            log.warning(
                "vqpoold still lists a session of pid %d %g s after it exited",
                pid,
                SESSION_GONE_TIMEOUT,
            )

    # -- operator ----------------------------------------------------------------------------------

    async def load(self, slot: ModelSlot, timeout: float) -> None:
        """Load ``slot``'s model as a request would (its keep-alive counts from now)."""
        async with self.lease(slot, None, timeout):
            pass

    async def unload(self, slot: ModelSlot, timeout: float) -> bool:
        """Unload ``slot``'s model as soon as its requests end; whether it is unloaded within
        ``timeout`` seconds (else it goes when they end)."""
        if slot.state == NOT_LOADED:
            return True
        slot.unload_when_idle = True
        self._settle(slot)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while slot.state != NOT_LOADED:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            await self._wait_for_change(remaining)
        return True

    async def exit_reason(self, worker: WorkerProcess, error: BaseException) -> str:
        """Why a proxied request to ``worker`` failed: its crash when it exited, else
        ``error``."""
        try:
            status = await asyncio.wait_for(asyncio.shield(worker.wait()), EXIT_REASON_WAIT)
        except TimeoutError:
            return f"the worker of {worker.entry.name} failed the request: {error}"
        return worker.exit_reason(status)

    async def start(self) -> None:
        """Learn each model's weight bytes before any loads (headers only, off the event loop;
        a model whose files cannot tell stays unknown, with a warning saying why), then watch
        the budget for a live change."""
        for slot in self.slots.values():
            slot.weights = await asyncio.to_thread(_weights_or_none, slot.entry)
            slot.cache_limit = _cache_limit(slot.entry, slot.weights)
        self._start(self._watch_budget())

    def views(self) -> list[dict[str, Any]]:
        now = asyncio.get_running_loop().time()
        return [slot.view(now) for slot in self.slots.values()]

    # -- plumbing ----------------------------------------------------------------------------------

    def _start(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("a supervisor task failed", exc_info=task.exception())

    def _notify(self) -> None:
        """Wake every waiter: something changed that may let it go on."""
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)
        self._changed = None
        if not self._closing:
            asyncio.get_running_loop().call_soon(self._schedule)

    async def _wait_for_change(self, timeout: float) -> None:
        if self._changed is None:
            self._changed = asyncio.get_running_loop().create_future()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._changed), timeout)

    async def close(self) -> None:
        """Stop every worker (each ends its running requests first) and wait for them."""
        self._closing = True
        if self._grace_timer is not None:
            self._grace_timer.cancel()
        self._notify()
        for slot in self.slots.values():
            self._touch(slot)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        stopping = []
        for slot in self.slots.values():
            if slot.worker is not None and slot.state in (LOADED, LOADING, UNLOADING):
                stopping.append(self._unload(slot, "shutdown"))
        await asyncio.gather(*stopping, return_exceptions=True)
