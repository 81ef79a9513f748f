"""The memory budget as the wire shows it: the ``budget`` and ``model_list`` admin ops' maps,
the ``fit`` answer, and the error of a request the budget does not grant (docs/protocol.md,
"Memory budget"). Without a budget (an unlimited ledger) the budget, its free bytes and limits
that are only the budget's show as None."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from vqpool.daemon.budget.ledger import BudgetLedger
from vqpool.daemon.budget.measured import model_memory
from vqpool.daemon.budget.types import FitAnswer, Outcome, Verdict
from vqpool.daemon.core.sessions import Session
from vqpool.shared.byte_sizes import MAX_BYTES, format_bytes
from vqpool.shared.errors import BlockPoolExhaustedError, OverBudgetError


def is_limited(ledger: BudgetLedger) -> bool:
    """Whether a real budget is set (the daemon's ledger without one has 1 PiB)."""
    return ledger.budget < MAX_BYTES


def budget_text(ledger: BudgetLedger) -> str:
    """The budget for a message: its size, or "unlimited"."""
    return format_bytes(ledger.budget) if is_limited(ledger) else "unlimited"


def held_text(ledger: BudgetLedger) -> str:
    """What the budget holds, for a message: its KV, and its weights when any are charged."""
    held = format_bytes(ledger.total_held)
    if ledger.total_weights:
        return f"{held} of KV and {format_bytes(ledger.total_weights)} of weights"
    return held


def refusal(ledger: BudgetLedger, op: str, verdict: Verdict) -> Exception:
    """The error of a request that is not granted (now, or ever)."""
    text = f"{op}: memory budget {budget_text(ledger)}: {verdict.message()}"
    if verdict.outcome is Outcome.NEVER:
        return OverBudgetError(text)
    return BlockPoolExhaustedError(text)


def budget_view(
    ledger: BudgetLedger, now: float, refused: int = 0, overhead: int = 0
) -> dict[str, Any]:
    """The ``budget`` admin op's answer; ``refused``: parked requests a change refused;
    ``overhead``: the part of the ledger's weights that is the workers' declared overhead
    (shown apart: ``total_weights`` is the parameters')."""
    snap = ledger.snapshot(now)
    limited = is_limited(ledger)
    return {
        "budget": snap.budget if limited else None,
        "total_held": snap.total_held,
        "total_weights": snap.total_weights - overhead,
        "total_overhead": overhead,
        "free": snap.free if limited else None,
        "over_budget": snap.over_budget > 0,
        "reserved": snap.reserved,
        "protected": snap.protected,
        "lend_reserves": snap.lend_reserves,
        "lent": snap.lent,
        "waiting": snap.waiting,
        "refused": refused,
    }


def model_views(
    ledger: BudgetLedger,
    sessions: Iterable[Session],
    now: float,
    settings_from: Callable[[str], dict[str, str]] | None = None,
    formats: Mapping[str, dict[str, dict[str, int]]] | None = None,
    overheads: dict[str, int] | None = None,
) -> list[dict[str, Any]]:
    """One view per model the ledger knows or a live session serves, by name; with
    ``settings_from``, where each of its settings comes from (``live``, ``config``,
    ``default``). ``formats``: per model, its blocks and bytes held per block format
    (``{format: {"blocks", "bytes"}}``; none: {}). ``overheads``: per model, the part of its
    charged weights that is its workers' declared overhead (``overhead``, apart from
    ``weights``). ``memory``: its workers' last memory reports beside what is declared for it
    (:meth:`ModelMemory.view`), or None when none reported."""
    snap = ledger.snapshot(now)
    sessions = list(sessions)
    load: dict[str, list[int]] = {}
    for session in sessions:
        counts = load.setdefault(session.model, [0, 0, 0])
        counts[0] += 1
        counts[1] += session.running or 0
        counts[2] += session.queued or 0
    limited = is_limited(ledger)
    views = []
    for name in sorted(snap.models.keys() | load.keys()):
        n_sessions, running, queued = load.get(name, (0, 0, 0))
        view = snap.models.get(name)
        row: dict[str, Any]
        if view is None:  # served, but never asked the budget for anything yet
            settings = ledger.settings_of(name)
            limit = settings.limit
            row = {
                "held": 0,
                "weights": 0,
                "reserve": settings.reserve,
                "limit": limit,
                "effective_limit": ledger.budget if limit is None else min(limit, ledger.budget),
                "weight": settings.weight,
                "borrowed": 0,
                "entitlement": 0,
                "waiting": 0,
                "waiting_bytes": 0,
                "oldest_wait_s": None,
                "configured": False,
                "lent": 0,
            }
        else:
            row = {
                "held": view.held,
                "weights": view.weights,
                "reserve": view.reserve,
                "limit": view.limit,
                "effective_limit": view.effective_limit,
                "weight": view.weight,
                "borrowed": view.borrowed,
                "entitlement": view.entitlement,
                "waiting": view.waiting,
                "waiting_bytes": view.waiting_bytes,
                "oldest_wait_s": view.oldest_wait_s,
                "configured": view.configured,
                "lent": view.lent,
            }
        row["overhead"] = (overheads or {}).get(name, 0)
        row["weights"] -= row["overhead"]
        if not limited and row["limit"] is None:
            row["effective_limit"] = None
        if settings_from is not None:
            row["settings_from"] = settings_from(name)
        memory = model_memory(sessions, name, row["held"])
        row["memory"] = None if memory is None else memory.view()
        row["formats"] = (formats or {}).get(name, {})
        views.append(
            {"model": name, **row, "sessions": n_sessions, "running": running, "queued": queued}
        )
    return views


def fit_to_wire(ledger: BudgetLedger, answer: FitAnswer, per_sequence: int) -> dict[str, Any]:
    """A :class:`FitAnswer` as the ``fit`` op's map."""
    limited = is_limited(ledger)
    return {
        "verdict": answer.verdict,
        "need": answer.need,
        "held": answer.held,
        "available_now": answer.available_now,
        "available_after_return": answer.available_after_return,
        "most_ever": answer.most_ever,
        "reserve": answer.reserve,
        "limit": answer.limit if limited or answer.limit < ledger.budget else None,
        "max_concurrency_now": answer.max_concurrency_now,
        "max_concurrency_ever": answer.max_concurrency_ever,
        "own_cache_now": answer.own_cache_now,
        "bytes_per_sequence": per_sequence,
        "budget": ledger.budget if limited else None,
    }
