"""Fair shares of the budget: weighted max-min water-filling, and each model's entitlement (its
share of what the models hold and wait for). Pure functions over the ledger's model records."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from vqpool.daemon.budget.waiting import ModelRecord


def water_fill(capacity: float, shares: Sequence[tuple[float, float, float]]) -> list[float]:
    """Weighted max-min shares of ``capacity``: ``shares`` holds (floor, cap, weight) per party.

    Each party gets ``min(cap, max(floor, level * weight))`` for the one ``level`` at which the
    total is ``capacity``, or its cap if all caps fit. Floors must fit the capacity together and
    each floor must be at most its cap (the ledger's reserves and limits guarantee both).
    O(n log n).
    """
    base = float(sum(floor for floor, _, _ in shares))
    if base >= capacity:
        return [floor for floor, _, _ in shares]
    if sum(cap for _, cap, _ in shares) <= capacity:
        return [cap for _, cap, _ in shares]
    # Sweep the level upwards over the points where a party starts growing (floor/weight) or
    # stops (cap/weight). Between two points the total is base + slope * level.
    events: list[tuple[float, int, int]] = []  # (level, 0 = starts / 1 = stops, party)
    for i, (floor, cap, weight) in enumerate(shares):
        if cap > floor:
            events.append((floor / weight, 0, i))
            events.append((cap / weight, 1, i))
    events.sort()
    slope = 0.0
    for at, kind, i in events:
        if slope > 0 and base + slope * at >= capacity:
            break
        floor, cap, weight = shares[i]
        if kind == 0:
            slope += weight
            base -= floor
        else:
            slope -= weight
            base += cap
    else:  # only float rounding gets here: the caps were checked to be over the capacity
        return [cap for _, cap, _ in shares]
    level = (capacity - base) / slope
    return [min(cap, max(floor, level * weight)) for floor, cap, weight in shares]


def entitlements(
    records: Iterable[ModelRecord],
    budget: int,
    lend_reserves: bool,
    wanting_all: ModelRecord | None = None,
) -> dict[ModelRecord, float]:
    """Each model's water-filling share for demand = held + waiting bytes (see
    :class:`~vqpool.daemon.budget.types.ModelBudgetView`). The capacity shared is the budget
    less the reserves that sit idle (reserve above demand): other models never get those bytes,
    unless reserves are lent, when the capacity is the whole budget. ``wanting_all``'s demand
    is taken as its limit (its full share, for the ledger's reclaim margin)."""
    recs = []
    shares = []
    idle_reserves = 0
    for rec in records:
        demand = rec.limit if rec is wanting_all else rec.held + rec.waiting_bytes
        if demand < rec.reserve:
            idle_reserves += rec.reserve - demand
        if demand:
            recs.append(rec)
            shares.append((min(demand, rec.reserve), min(demand, rec.limit), rec.weight))
    capacity = budget if lend_reserves else budget - idle_reserves
    return dict(zip(recs, water_fill(capacity, shares), strict=True))
