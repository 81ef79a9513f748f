"""Fair shares of the budget: weighted max-min water-filling, and each model's entitlement (its
share of what the models hold and wait for). Pure functions over the ledger's model records."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence
from itertools import accumulate

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


class ShareTable:
    """One water-filling of the models' demand (:func:`entitlements`), and from it each model's
    *full share* (its entitlement were its demand its limit, the others' unchanged) in
    O(log n) per model instead of a water-filling each.

    The total handed out at a water level ``l`` is piecewise linear in ``l``: each party gives
    its floor below ``floor / weight``, ``l * weight`` up to ``cap / weight``, its cap above.
    Sorted breakpoints with prefix sums give that total at any level in O(log n); a full share
    swaps one party's term and finds the level where the total meets the capacity by bisection
    over the breakpoints.
    """

    def __init__(self, records: Iterable[ModelRecord], budget: int, lend_reserves: bool) -> None:
        recs = []
        shares = []
        idle_reserves = 0
        for rec in records:
            demand = rec.held + rec.waiting_bytes
            if demand < rec.reserve:
                idle_reserves += rec.reserve - demand
            if demand:
                recs.append(rec)
                shares.append((min(demand, rec.reserve), min(demand, rec.limit), rec.weight))
        self._lend = lend_reserves
        self.capacity = budget if lend_reserves else budget - idle_reserves
        self.entitlement = dict(zip(recs, water_fill(self.capacity, shares), strict=True))
        self._party = dict(zip(recs, shares, strict=True))
        self._floors = float(sum(floor for floor, _, _ in shares))
        self._caps = float(sum(cap for _, cap, _ in shares))
        growing = [share for share in shares if share[1] > share[0]]
        self._fixed = float(sum(floor for floor, cap, _ in shares if cap <= floor))
        by_start = sorted(growing, key=lambda s: s[0] / s[2])
        by_end = sorted(growing, key=lambda s: s[1] / s[2])
        self._starts = [floor / weight for floor, _, weight in by_start]
        self._ends = [cap / weight for _, cap, weight in by_end]
        # Floors of the parties not started yet (from index i on), weights of those started
        # (before i), caps and weights of those stopped (before j).
        self._floor_after = list(accumulate([s[0] for s in reversed(by_start)], initial=0.0))[::-1]
        self._weight_started = list(accumulate([s[2] for s in by_start], initial=0.0))
        self._cap_stopped = list(accumulate([s[1] for s in by_end], initial=0.0))
        self._weight_stopped = list(accumulate([s[2] for s in by_end], initial=0.0))
        self._points = sorted({0.0, *self._starts, *self._ends})

    def _total(self, level: float) -> float:
        i = bisect_right(self._starts, level)
        j = bisect_right(self._ends, level)
        return (
            self._fixed
            + self._floor_after[i]
            + self._cap_stopped[j]
            + level * (self._weight_started[i] - self._weight_stopped[j])
        )

    def full_share(self, rec: ModelRecord) -> float:
        """``rec``'s entitlement were its demand its limit (``entitlements(..., wanting_all=rec)``
        up to float rounding)."""
        new_floor, new_cap, weight = float(rec.reserve), float(rec.limit), rec.weight
        if new_cap <= 0:
            return 0.0
        old = self._party.get(rec)
        old_floor, old_cap = (0.0, 0.0) if old is None else (float(old[0]), float(old[1]))
        capacity = float(self.capacity)
        if not self._lend:
            demand = rec.held + rec.waiting_bytes
            capacity += rec.reserve - demand if demand < rec.reserve else 0
        floors = self._floors - old_floor + new_floor
        if floors >= capacity:
            return new_floor
        if self._caps - old_cap + new_cap <= capacity:
            return new_cap

        def total(level: float) -> float:
            own = min(new_cap, max(new_floor, level * weight))
            if old is None:
                return self._total(level) + own
            return self._total(level) - min(old_cap, max(old_floor, level * weight)) + own

        points = self._points
        lo, hi = 0, len(points)  # the first point where the total reaches the capacity
        while lo < hi:
            mid = (lo + hi) // 2
            if total(points[mid]) >= capacity:
                hi = mid
            else:
                lo = mid + 1
        low = points[lo - 1] if lo else 0.0
        high = points[lo] if lo < len(points) else max(new_cap / weight, low)
        # Between two breakpoints of the others only this party's own may bend the total.
        for kink in sorted((new_floor / weight, new_cap / weight)):
            if low < kink < high:
                if total(kink) >= capacity:
                    high = kink
                else:
                    low = kink
        at_low, at_high = total(low), total(high)
        if at_high <= at_low:
            level = high
        else:
            level = low + (capacity - at_low) * (high - low) / (at_high - at_low)
        return min(new_cap, max(new_floor, level * weight))
