"""The byte budget wired into the daemon: the layer the ops call for every change of holdings.

The ledger (``budget/ledger.py``) knows bytes per model; the holdings (``budget/holdings.py``)
price blocks in bytes and keep the ledger in step as the coordinator hands blocks out and takes
them back; allocations that wait for bytes are parked (``budget/parking.py``); workers are asked
to give bytes back by reclaim (``budget/reclaim_service.py``). :class:`BudgetAccounting` holds
them together, and does what needs several of them: an allocation that may wait, the end of a
session, a live settings change, the views. The coordinator below never calls up into any of
them. See docs/budget.md and docs/protocol.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from vqpool.daemon.budget.holdings import Holdings, Items
from vqpool.daemon.budget.ledger import BudgetLedger
from vqpool.daemon.budget.live_settings import LiveSettings
from vqpool.daemon.budget.load_reservations import LoadReservations, reservation_key
from vqpool.daemon.budget.measured import DriftWatch, model_memory
from vqpool.daemon.budget.parking import ParkedRequest, Parking
from vqpool.daemon.budget.reclaim_book import DEFAULT_RECLAIM_DEADLINE
from vqpool.daemon.budget.reclaim_service import ReclaimService
from vqpool.daemon.budget.sequence_pricing import SequencePricing
from vqpool.daemon.budget.types import LoadOutcome, ModelSettings, Outcome
from vqpool.daemon.budget.views import (
    budget_view,
    fit_to_wire,
    is_limited,
    model_views,
    refusal,
)
from vqpool.daemon.core.coordinator import Coordinator
from vqpool.daemon.core.sessions import Session
from vqpool.daemon.core.views import priced_holdings
from vqpool.shared.byte_sizes import MAX_BYTES, format_bytes
from vqpool.shared.model_names import resolve_model
from vqpool.shared.protocol import ALLOCATE

log = logging.getLogger("vqpoold")

MIN_BYTES_PER_SLOT = 16
"""Under a budget, the fewest bytes a session may declare per token slot of a block, per stream:
one layer of one KV head of 8 dims at 2 bytes (fp16). No model holds less (the built-in tiny
models hold 256 bytes a slot, real ones kilobytes); at the default 16 slots a block, 256 bytes.
Below it a session would take blocks the ledger barely counts: with 0 bytes every block, with 1
byte a million ids for a megabyte of the budget."""


def session_key(session: Session) -> tuple[str, int]:
    """The ledger's holder key of a session's weights."""
    return ("session", session.sid)


class BudgetAccounting:
    """The daemon's ledger, the sessions' holdings in bytes, the parked allocations and reclaim.

    Args:
        coord: The coordinator whose allocator and sessions hold the blocks.
        budget: Bytes all models may hold together, or None for no budget (an unlimited ledger
            that still counts, so per-model limits and views work).
        models: Settings of the configured models.
        lend_reserves: Let models borrow other models' unused reserves (taken back by reclaim).
        reclaim_deadline: Seconds a worker has to answer a reclaim ask.
        live: Where live settings changes are kept (``budget/live_settings.py``): ``budget``
            and ``models`` are then its settings in effect (None: kept in memory only).

    Raises:
        ValueError: Reserves summing over the budget, or bad settings.
    """

    def __init__(
        self,
        coord: Coordinator,
        budget: int | None,
        models: Mapping[str, ModelSettings] | None = None,
        *,
        lend_reserves: bool = False,
        reclaim_deadline: float = DEFAULT_RECLAIM_DEADLINE,
        live: LiveSettings | None = None,
    ) -> None:
        self._coord = coord
        self.live = LiveSettings(None, budget, models or {}) if live is None else live
        self.ledger = BudgetLedger(
            MAX_BYTES if budget is None else budget, models, lend_reserves=lend_reserves
        )
        self.holdings = Holdings(coord, self.ledger)
        self.parking = Parking(self.holdings, coord.replies, coord.boot_id)
        self.reclaim = ReclaimService(coord, self.holdings, self.parking, reclaim_deadline)
        self.drift = DriftWatch()
        self.loads = LoadReservations()

    @property
    def limited(self) -> bool:
        """Whether a real budget is set (else every view shows ``budget: null``)."""
        return is_limited(self.ledger)

    # -- hello ---------------------------------------------------------------------------------

    def check_hello(
        self,
        bytes_per_block: Mapping[str, int],
        streams: Sequence[str],
        name: str = "bytes_per_block",
    ) -> None:
        """Refuse a session that the budget could not bound while a budget is set: one that
        declares no bytes per block for a pool stream, or fewer than any model's block holds
        (:data:`MIN_BYTES_PER_SLOT` per slot: with 0 or 1 byte a session takes blocks the
        ledger barely counts). ``name`` is the hello argument checked (a format's entry of
        ``bytes_per_format`` is checked as ``bytes_per_block``).

        Raises:
            ValueError: A pool stream without bytes per block, or with too few.
        """
        if self.limited:
            missing = [s for s in streams if s not in bytes_per_block]
            if missing:
                raise ValueError(
                    f"hello: a memory budget is set, so {name} must be declared for "
                    f"every pool stream ({'+'.join(streams)}); missing: {missing}"
                )
            block_size = self._coord.allocator.config.block_size
            floor = MIN_BYTES_PER_SLOT * block_size
            small = {s: bytes_per_block[s] for s in streams if bytes_per_block[s] < floor}
            if small:
                raise ValueError(
                    f"hello: a memory budget is set, so {name} must be at least {floor} "
                    f"per pool stream (what one layer of one head of 8 dims at 2 bytes holds in "
                    f"a block of {block_size} slots; a real model's block is kilobytes); got "
                    f"{small}"
                )

    # -- weights -------------------------------------------------------------------------------

    def charge_weights(self, session: Session, n_bytes: int) -> None:
        """Charge ``n_bytes`` of weights to ``session`` (its hello, its heartbeat's measurement:
        the charge follows the latest), with the overhead it declared at hello: the ledger
        charges the sum, the model's fixed cost. The first charge of a session takes over the
        oldest pending load reservation of its model in the same step: no double count, no
        gap."""
        ledger = self.ledger
        key = session_key(session)
        fixed = n_bytes + session.overhead if n_bytes else 0
        if fixed and not ledger.weights_of(session.model, key):
            taken = self.loads.pop_oldest(session.model)
            if taken is not None:
                ledger.set_weights(session.model, reservation_key(taken.ticket), 0)
                log.info(
                    "load reservation %s of model %r (%s) taken over by session %x",
                    taken.ticket,
                    taken.model,
                    format_bytes(taken.weights),
                    session.sid,
                )
        ledger.set_weights(session.model, key, fixed)
        self.parking.hand_out()

    def charged_weights(self, session: Session) -> int:
        """Bytes of weights charged to ``session``, its overhead not counted (0: none)."""
        fixed = self.ledger.weights_of(session.model, session_key(session))
        return max(0, fixed - session.overhead) if fixed else 0

    def overheads(self) -> dict[str, int]:
        """Per model, the overhead charged beside its weights: its sessions' with weights
        charged and its pending load reservations'."""
        found: dict[str, int] = {}
        for session in self._coord.sessions:
            if session.overhead and self.ledger.weights_of(session.model, session_key(session)):
                found[session.model] = found.get(session.model, 0) + session.overhead
        for pending in self.loads.pending.values():
            found[pending.model] = found.get(pending.model, 0) + pending.overhead
        return found

    def reserve_load(
        self, model: str, weights: int, kv_min: int, ttl: float, now: float, overhead: int = 0
    ) -> dict[str, Any]:
        """The ``load_reserve`` admin op's answer (see its declaration): the weights and
        overhead charged under a new ticket, or how many bytes are short (with the prompt
        caches asked back).

        Raises:
            ValueError: It can never fit (the message names the numbers), or too many
                reservations are pending.
        """
        self.loads.check_room()
        ticket = self.loads.new_ticket()
        fixed = weights + overhead
        verdict = self.ledger.reserve_load(model, reservation_key(ticket), fixed, kv_min)
        if verdict.outcome is LoadOutcome.NEVER:
            raise ValueError(f"load_reserve: {verdict.message(overhead)}")
        if verdict.outcome is LoadOutcome.GRANT:
            self.loads.add(ticket, model, weights, kv_min, now + ttl, overhead)
            log.info("load reservation %s: %s (for %gs)", ticket, verdict.message(overhead), ttl)
            return {"granted": True, "ticket": ticket, "free": verdict.free - fixed}
        return {
            "granted": False,
            "short": verdict.short,
            "free": verdict.free,
            "weights": weights,
            "overhead": overhead,
            "kv_min": kv_min,
            "cached": self.ask_caches(verdict.short),
        }

    def release_load(self, ticket: str) -> bool:
        """Give back a pending load reservation; whether it was pending."""
        found = self.loads.pop(ticket)
        if found is None:
            return False
        self._drop_reservation(found.model, ticket)
        log.info("load reservation %s of model %r released", ticket, found.model)
        return True

    def _drop_reservation(self, model: str, ticket: str) -> None:
        """Uncharge a reservation's weights; its model leaves the ledger if nothing else keeps
        it there (no session, no holdings, no settings)."""
        self.ledger.set_weights(model, reservation_key(ticket), 0)
        if all(s.model != model for s in self._coord.sessions):
            self.ledger.forget_model(model)
        self.parking.hand_out()

    def expire_loads(self, now: float) -> None:
        """Give back the load reservations whose time to live passed with no hello."""
        for found in self.loads.expire(now):
            self._drop_reservation(found.model, found.ticket)
            log.warning(
                "load reservation %s of model %r (%s) expired: no worker of it said hello",
                found.ticket,
                found.model,
                format_bytes(found.weights),
            )

    def ask_caches(self, n_bytes: int) -> int:
        """Ask workers' prompt caches for up to ``n_bytes``, least recently used first across
        models (each told in the answer to its next heartbeat); the bytes asked."""
        asked = 0
        cached = [s for s in self._coord.sessions if s.prompt_cache and s.prompt_cache["bytes"]]
        cached.sort(key=lambda s: s.cache_used_at)
        for session in cached:
            if asked >= n_bytes:
                break
            assert session.prompt_cache is not None
            ask = min(session.prompt_cache["bytes"] - session.release_cache, n_bytes - asked)
            if ask > 0:
                session.release_cache += ask
                asked += ask
        return asked

    # -- allocations ---------------------------------------------------------------------------

    def allocate(
        self, session: Session, op: str, args: dict[str, Any], rid: int, now: float
    ) -> Any:
        """``allocate`` / ``allocate_many`` of ``session`` under the budget: the result, or the
        :class:`~vqpool.daemon.budget.parking.ParkedRequest` when it waits (no reply now).

        Raises:
            OverBudgetError: It can never fit.
            BlockPoolExhaustedError: Not now and not waiting (``wait`` 0, queues full).
        """
        if not session.bytes_per_block and not session.bytes_per_format:
            # not bounded by the budget: nothing to count (the hot path without one)
            if op == ALLOCATE:
                return self._coord.allocate(
                    session, args["stream"], args["n_tokens"], args["owner"], args["format"]
                )
            return self._coord.allocate_many(session, args["items"])
        holdings = self.holdings
        if op == ALLOCATE:
            self._coord.check_allocate(session, args["n_tokens"], args["owner"])
            if not args["wait"]:
                return holdings.allocate_now(session, args)
        items: Items
        if op == ALLOCATE:
            items = ((args["stream"], args["n_tokens"], args["owner"], args["format"]),)
        else:
            items = args["items"]
        n_bytes = holdings.bytes_of(items, session)
        if not n_bytes:
            return holdings.perform(session, op, items, 0)
        ledger = self.ledger
        wait = args["wait"]
        growth = args["growth"]
        if wait > 0:
            self.parking.check_room(session, op, items)  # what waiting requests may keep
            # A growth's party is its session: one growth of each session waits at a time.
            verdict = ledger.request(
                session.model,
                n_bytes,
                (session.sid, rid),
                now + wait,
                now,
                growth=session.sid if growth else None,
            )
            if verdict.queued:
                parked = ParkedRequest(session, op, items, rid, n_bytes, wait, now, growth)
                return self.parking.park(parked)
        else:
            verdict = ledger.try_grant(session.model, n_bytes, growth=growth)
        if verdict.outcome is not Outcome.GRANT:
            raise refusal(ledger, op, verdict)
        return holdings.perform(session, op, items, n_bytes)

    # -- sessions ending -----------------------------------------------------------------------

    def end_session(self, session: Session) -> tuple[int, int]:
        """End ``session``: its blocks freed and credited, its owners released, its reclaim
        state and parked allocations dropped (never answered: nobody is left to read them), and
        a model no session serves any more forgotten unless configured.

        Returns (owners released, blocks freed).
        """
        ended = self.holdings.end_session(session)
        self.ledger.set_weights(session.model, session_key(session), 0)
        self.reclaim.session_ended(session)
        self.parking.session_ended(session)
        if not any(s.model == session.model for s in self._coord.sessions):
            self.ledger.forget_model(session.model)
            self.drift.forget(session.model)
        return ended.n_owners, ended.n_blocks

    def reap_dead_sessions(self, now: float) -> None:
        """End every session whose worker exited or stayed stopped past its lease."""
        coord = self._coord
        for session, reason in coord.dead_sessions(now):
            n_owners, n_blocks = self.end_session(session)
            coord.n_sessions_reaped += 1
            log.info(
                "reaped session %x (pid %d, model %r): %s; freed %d block(s) of %d owner(s)",
                session.sid,
                session.pid,
                session.model,
                reason,
                n_blocks,
                n_owners,
            )

    # -- settings ------------------------------------------------------------------------------

    def set_budget(self, budget: int) -> int:
        """Change the budget live; parked allocations it made impossible are answered (how
        many)."""
        refused = self.parking.answer_refused(self.ledger.set_budget(budget))
        self.live.set_budget(budget)
        self.parking.hand_out()
        return refused

    def set_model(self, model: str, settings: ModelSettings, fields: Iterable[str]) -> int:
        """Change a model's settings live (``fields``: those set; kept as set live); as
        :meth:`set_budget`. A limit below what the model holds is met by reclaim from the
        model's own sessions (``plan_limits``)."""
        self.live.check_room(model)
        refused = self.parking.answer_refused(self.ledger.set_model(model, settings))
        self.live.set_model(model, {field: getattr(settings, field) for field in fields})
        self.reclaim.limit_changed(model)
        self.parking.hand_out()
        return refused

    def unset_model(self, model: str) -> int:
        """Drop a model's live settings: it falls back to the config file's, or to the defaults
        (and leaves the ledger if it holds and waits for nothing and no worker serves it); as
        :meth:`set_budget`.

        Raises:
            ValueError: ``model`` has no live settings, or its config file's reserve no longer
                fits the budget (nothing changes).
        """
        live = self.live
        if model not in live.models:
            where = "the config file" if model in live.config_models else "the defaults"
            raise ValueError(f"model {model!r} has no live settings (its settings are {where}'s)")
        configured = model in live.config_models
        refused = self.parking.answer_refused(
            self.ledger.set_model(model, live.base(model), configured=configured)
        )
        live.unset_model(model)
        self.reclaim.limit_changed(model)  # the config file's limit may be lower
        if not configured and all(s.model != model for s in self._coord.sessions):
            self.ledger.forget_model(model)
        self.parking.hand_out()
        return refused

    # -- names ---------------------------------------------------------------------------------

    def known_models(self) -> set[str]:
        """The models the daemon knows: served by a connected worker, in the ledger (holding
        bytes, waiting, or with settings of their own), or in the config file."""
        return (
            {s.model for s in self._coord.sessions}
            | self.ledger.snapshot().models.keys()
            | self.live.config_models.keys()
        )

    def resolve(self, given: str) -> str | None:
        """The full name of the known model ``given`` names (its name, or a label that names
        only it: :func:`~vqpool.shared.model_names.resolve_model`), or None.

        Raises:
            ValueError: ``given`` is ambiguous (the message names the candidates).
        """
        return resolve_model(given, self.known_models())

    def model_named(self, given: str, *, create: bool = False) -> str:
        """As :meth:`resolve`, for a model that must be known; with ``create``, ``given`` is
        taken as the full name of a model, known or not.

        Raises:
            ValueError: ``given`` is ambiguous, or names no known model (and not ``create``).
        """
        if create:
            return given
        found = self.resolve(given)
        if found is not None:
            return found
        raise ValueError(
            f"no model {given!r}: no worker of it is connected, the config file does not name "
            "it and it has no settings; check the name (`vqpoolctl model list`), or set it "
            "ahead of its workers with create (`vqpoolctl model set NAME --create`)"
        )

    def note_memory(self, session: Session, report: dict[str, int], now: float) -> None:
        """Keep the memory ``report`` of ``session``'s process, and warn if its model's measured
        memory now drifts from what is declared for it (O(sessions): once per heartbeat)."""
        session.memory = report
        model = session.model
        if report["weights"] != self.charged_weights(session):
            self.charge_weights(session, report["weights"])
        memory = model_memory(self._coord.sessions, model, self.ledger.held(model))
        self.drift.check(model, memory, now)

    # -- reads ---------------------------------------------------------------------------------

    def view(self, now: float, refused: int = 0) -> dict[str, Any]:
        """The ``budget`` admin op's answer, with the reclaim counters."""
        overhead = sum(self.overheads().values())
        return {**budget_view(self.ledger, now, refused, overhead), "reclaim": self.reclaim.view()}

    def model_views(self, now: float) -> list[dict[str, Any]]:
        """The ``model_list`` admin op's views."""
        formats: dict[str, dict[str, dict[str, int]]] = {}
        for session in self._coord.sessions:
            model = formats.setdefault(session.model, {})
            for fmt, held in priced_holdings(self._coord, session)[1].items():
                row = model.setdefault(fmt, {"blocks": 0, "bytes": 0})
                row["blocks"] += held["blocks"]
                row["bytes"] += held["bytes"]
        return model_views(
            self.ledger,
            self._coord.sessions,
            now,
            self.live.settings_from,
            {name: dict(sorted(held.items())) for name, held in formats.items()},
            self.overheads(),
        )

    def model_view(self, name: str, now: float) -> dict[str, Any]:
        """The view of one model the ledger knows or a session serves."""
        return next(v for v in self.model_views(now) if v["model"] == name)

    def fit(
        self,
        model: str,
        pricing: SequencePricing,
        context: int,
        concurrency: int,
        new_weights: int = 0,
    ) -> dict[str, Any]:
        """The fit answer for ``concurrency`` sequences of ``context`` tokens of ``model``
        (``pricing``'s bytes per block per pool stream, or one total under the key ``"all"``
        for a model not loaded; ``new_weights``: the weights its load would add)."""
        allocator = self._coord.allocator
        per_sequence = pricing.per_sequence(context, allocator.config.block_size, allocator.streams)
        if per_sequence == 0:
            raise ValueError(
                f"fit: model {model!r} declared 0 bytes per block: the budget does not bound it"
            )
        # Its workers' idle prompt caches (reported in their pings): blocks it holds that they
        # give back before a request of theirs waits, so available to it now.
        own_cache = sum(
            s.prompt_cache.get("bytes", 0)
            for s in self._coord.sessions
            if s.model == model and s.prompt_cache
        )
        answer = self.ledger.fit(model, per_sequence, concurrency, own_cache, new_weights)
        return fit_to_wire(self.ledger, answer, per_sequence)

    def loaded_models(self) -> dict[str, dict[str, Any]]:
        """Per model with weights charged: its weights, its workers' overhead, KV held,
        prompt-cache bytes its workers report, and whether it is idle (holds no KV beyond its
        prompt cache, waits for nothing, runs and queues nothing): what unloading it would
        free."""
        snap = self.ledger.snapshot()
        overheads = self.overheads()
        found: dict[str, dict[str, Any]] = {}
        busy: set[str] = set()
        cached: dict[str, int] = {}
        for session in self._coord.sessions:
            if session.running or session.queued:
                busy.add(session.model)
            if session.prompt_cache:
                cached[session.model] = cached.get(session.model, 0) + session.prompt_cache["bytes"]
        for name, view in sorted(snap.models.items()):
            if not view.weights:
                continue
            in_cache = min(cached.get(name, 0), view.held)
            idle = view.held <= in_cache and not view.waiting and name not in busy
            overhead = overheads.get(name, 0)
            found[name] = {
                "weights": view.weights - overhead,
                "overhead": overhead,
                "held": view.held,
                "cached": in_cache,
                "idle": idle,
            }
        return found

    def breaches(self) -> list[str]:
        """Held bytes past the ledger's rules, for ``audit``: over the budget, a model over its
        limit, reserves held by other models while reserves are not lent.

        No grant or claim makes one (each is checked); a budget or a limit lowered live below
        what is held does, until the holders give the excess back (reclaim asks them)."""
        snap = self.ledger.snapshot()
        fb = format_bytes
        found = []
        if self.limited and snap.over_budget:
            found.append(
                f"budget: {fb(snap.total_held)} of KV and {fb(snap.total_weights)} of weights "
                f"held, {fb(snap.over_budget)} over the budget "
                f"({fb(snap.budget)})"
            )
        for name, view in sorted(snap.models.items()):
            if view.limit is not None and view.held > view.limit:
                found.append(
                    f"budget: model {name!r} holds {fb(view.held)}, "
                    f"{fb(view.held - view.limit)} over its limit ({fb(view.limit)})"
                )
        if not snap.lend_reserves and snap.lent:
            found.append(
                f"budget: {fb(snap.lent)} of models' reserves are held by other models, and "
                "reserves are not lent"
            )
        return found

    def recount_problems(self) -> list[str]:
        """Disagreements between the ledger's bytes per model and a recount from the allocator's
        blocks per (stream, format) and the sessions' bytes per block of each format (for
        ``audit``). Granted-but-not-handed-out
        bytes of parked allocations count as held."""
        recount: dict[str, int] = {}
        holdings = self.holdings
        for session in self._coord.sessions:
            n = holdings.bytes_of_session(session)
            recount[session.model] = recount.get(session.model, 0) + n
        ledger = self.ledger
        for parked in self.parking.parked.values():
            if not ledger.is_waiting((parked.session.sid, parked.rid)):
                model = parked.session.model
                recount[model] = recount.get(model, 0) + parked.n_bytes
        problems = []
        for model in sorted(recount.keys() | ledger.snapshot().models.keys()):
            counted, held = recount.get(model, 0), ledger.held(model)
            if counted != held:
                problems.append(
                    f"budget: model {model!r} holds {held} bytes in the ledger but {counted} "
                    "by recount"
                )
        try:
            ledger.check_invariants()
        except AssertionError as exc:
            problems.append(f"budget ledger: {exc}")
        return problems
