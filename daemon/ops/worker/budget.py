"""Worker ops with the memory budget: whether sequences would fit, and reclaim (a worker's
long-poll for asks to give bytes back, and its answer)."""

from __future__ import annotations

import time
from typing import Any

from vqpool.daemon.budget.sequence_pricing import SequencePricing
from vqpool.daemon.core.sessions import Session
from vqpool.daemon.ops.op_table import Args
from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.kv_formats import parse_format
from vqpool.shared.protocol import INT64_MAX


def fit(state: DaemonState, session: Session, args: Args, rid: int, now: float) -> dict[str, Any]:
    pricing = fit_pricing(session)
    answer = fit_answer(state, session.model, pricing, args["context"], args["concurrency"])
    return {**answer, "format": pricing.format}


def fit_pricing(session: Session) -> SequencePricing:
    """How a sequence of ``session``'s worker is priced: its bytes per block in full
    precision and, when it declared a quantized format (the worker quantizes a sequence once
    it passes ``--quantized-kv-start``; the most costly, if it declared several), in that
    format, held as its hello said (first-pass slots, start)."""
    quantized = [
        (sum(costs.values()), fmt, costs)
        for fmt, costs in session.bytes_per_format.items()
        if parse_format(fmt) is not None
    ]
    full = [costs for fmt, costs in session.bytes_per_format.items() if parse_format(fmt) is None]
    fp = max(full, key=lambda costs: sum(costs.values())) if full else session.bytes_per_block
    if not quantized:
        return SequencePricing(fp)
    _, fmt, costs = max(quantized)
    return SequencePricing(fp, costs, fmt, session.quantization)


def fit_answer(
    state: DaemonState,
    model: str,
    pricing: SequencePricing,
    context: int,
    concurrency: int,
    new_weights: int = 0,
) -> dict[str, Any]:
    """The ``fit`` answer (worker op and admin op) for ``model`` priced by ``pricing``
    (``new_weights``: the weights a load of it would add, for a model not loaded), with its
    weights, the budget's free bytes and what each loaded model would free if unloaded.

    Raises:
        ValueError: Its byte counts would not fit the reply's integers (bytes per block far
            past any model's; context and concurrency are bounded by their declarations).
    """
    budget = state.budget
    answer = budget.fit(model, pricing, context, concurrency, new_weights)
    if answer["need"] > INT64_MAX:
        raise ValueError(
            f"fit: {concurrency} sequences of {context} tokens of {model} would need "
            f"{answer['need']} bytes, more than a reply carries; ask about fewer"
        )
    return {
        **answer,
        "weights": new_weights or budget.ledger.weights(model),
        "free": budget.ledger.free if budget.limited else None,
        "models": budget.loaded_models(),
    }


def reclaim_poll(state: DaemonState, session: Session, args: Args, rid: int, now: float) -> Any:
    return state.budget.reclaim.poll(session, rid, args["wait"], now)


def reclaim_done(
    state: DaemonState, session: Session, args: Args, rid: int, now: float
) -> dict[str, Any]:
    return state.budget.reclaim.done(session, args["ask"], args["freed"], time.monotonic())
