"""The memory budget as vqpoolctl shows it: the budget line and the per-model figures.

Reads the admin ops ``budget`` (the budget map) and ``model_list`` (that map and one view per
model); see docs/budget.md for what each figure means. Sizes print with
:func:`~vqpool.shared.byte_sizes.format_bytes`, so a size set as ``8GiB`` shows as ``8 GiB``.
"""

from __future__ import annotations

from typing import Any

from vqpool.daemon.ctl.labels import model_labels
from vqpool.daemon.ctl.render import duration, ellipsis, fit_fields, table
from vqpool.daemon.ctl.summaries import formats_text, shows_formats
from vqpool.shared.byte_sizes import format_bytes

MODEL_HEADERS = [
    "MODEL",
    "HELD",
    "WEIGHTS",
    "MEASURED",
    "RESERVE",
    "LIMIT",
    "WEIGHT",
    "BORROWED",
    "ENTITLED",
    "WAITING",
    "SESSIONS",
    "RUNNING/QUEUED",
    "SETTINGS",
]
RIGHT_ALIGNED = set(MODEL_HEADERS) - {"MODEL", "SESSIONS", "RUNNING/QUEUED", "SETTINGS"}
"""The columns of sizes and counts, right-aligned."""
LABEL_WIDTH = 40
"""The widest model label in tables (``--json`` has the full names)."""


def size(n: int | None, none: str = "none") -> str:
    """``n`` bytes for people, or ``none`` when there is no such bound (null on the wire)."""
    return none if n is None else format_bytes(n)


def weight(value: float) -> str:
    return f"{value:g}"


def waiting(view: dict[str, Any]) -> str:
    """Requests a model has parked at the daemon, with their bytes and how long the oldest has
    waited: ``2 (1.5 MiB, 3.2s)``, or ``0``."""
    if not view["waiting"]:
        return "0"
    age = "" if view["oldest_wait_s"] is None else f", {duration(view['oldest_wait_s'])}"
    return f"{view['waiting']} ({format_bytes(view['waiting_bytes'])}{age})"


def budget_fields(budget: dict[str, Any]) -> list[str]:
    """The budget map (``budget`` op) as short phrases, most important first."""
    held = format_bytes(budget["total_held"])
    weights_charged = budget.get("total_weights") or 0
    if weights_charged:  # KV and weights add up (docs/budget.md)
        held = f"{held} KV + {format_bytes(weights_charged)} weights"
    if budget["budget"] is None:
        fields = ["no budget (nothing binds)", f"held {held}"]
    else:
        fields = [
            f"budget {format_bytes(budget['budget'])}",
            f"held {held}",
            f"free {format_bytes(budget['free'])}",
        ]
        if budget["over_budget"]:
            over = format_bytes(budget["total_held"] + weights_charged - budget["budget"])
            fields.append(f"OVER BUDGET by {over}: no grants until holdings fall under it")
    fields.append(f"reserved {format_bytes(budget['reserved'])}")
    fields.append(f"unused reserves {format_bytes(budget['protected'])}")
    if budget.get("lend_reserves"):
        fields.append(f"lent {format_bytes(budget['lent'])}")
    fields.append(f"waiting {budget['waiting']}")
    return fields


def reclaim_line(reclaim: dict[str, Any]) -> str:
    """The reclaim counters (``budget`` op's ``reclaim`` map) as one line."""
    quantiles = [
        f"{name} {reclaim[key] * 1000:.0f} ms"
        for name, key in (("p50", "latency_p50_s"), ("p99", "latency_p99_s"))
        if reclaim[key] is not None
    ]
    latency = f" (answer {', '.join(quantiles)})" if quantiles else ""
    return (
        f"reclaim: asked {reclaim['asked']}, answered {reclaim['answered']}{latency}, late "
        f"{reclaim['late']}, given back {format_bytes(reclaim['bytes_reclaimed'])}; "
        f"preemptions {reclaim['preemptions']}"
    )


def budget_line(budget: dict[str, Any]) -> str:
    return ", ".join(budget_fields(budget))


def _running_queued(view: dict[str, Any]) -> str:
    running, queued = view.get("running"), view.get("queued")
    if running is None and queued is None:
        return "-"
    return f"{'-' if running is None else running}/{'-' if queued is None else queued}"


SOURCES = ("live", "config", "default")
"""Where a model's setting comes from (``settings_from`` of a ``model_list`` view)."""


def settings_source(view: dict[str, Any]) -> str:
    """Where a model's settings come from: ``config``, ``live``, ``default``, or per source
    the fields from it (``live: limit; config: reserve, weight``)."""
    sources: dict[str, str] = view.get("settings_from") or {}
    by_source = {
        source: [field for field, of in sources.items() if of == source] for source in SOURCES
    }
    used = [source for source in SOURCES if by_source[source]]
    if len(used) <= 1:
        return used[0] if used else "-"
    return "; ".join(f"{source}: {', '.join(by_source[source])}" for source in used)


def weights(view: dict[str, Any]) -> str:
    """A model's weights as charged to the budget (its workers' and pending loads'), else as
    its workers report them, or ``-`` when there are none."""
    charged = view.get("weights")
    if charged:
        return format_bytes(charged)
    memory = view.get("memory")
    return "-" if memory is None else format_bytes(memory["weights"])


def measured(view: dict[str, Any]) -> str:
    """What a model's worker processes hold, measured (``-``: none reports), marked ``DRIFT``
    when it is past the margin from what is declared (its KV held plus weights)."""
    memory = view.get("memory")
    if memory is None:
        return "-"
    return format_bytes(memory["measured"]) + (" DRIFT" if memory["drift"] else "")


def model_row(label: str, view: dict[str, Any]) -> list[object]:
    """One row of :data:`MODEL_HEADERS` for a ``model_list`` view."""
    return [
        label,
        format_bytes(view["held"]),
        weights(view),
        measured(view),
        format_bytes(view["reserve"]),
        size(view["limit"]),
        weight(view["weight"]),
        format_bytes(view["borrowed"]),
        format_bytes(view["entitlement"]),
        waiting(view),
        view["sessions"],
        _running_queued(view),
        settings_source(view),
    ]


def budget_report(listing: dict[str, Any]) -> list[str]:
    """The ``model_list`` reply as lines: the budget line, then a table of the models."""
    lines = [budget_line(listing["budget"])]
    reclaim = listing["budget"].get("reclaim")
    if reclaim is not None and (reclaim["asked"] or reclaim["preemptions"]):
        lines.append(reclaim_line(reclaim))
    views = listing["models"]
    if not views:
        return [*lines, "no models: no worker is connected and none is configured"]
    labels = model_labels([v["model"] for v in views], LABEL_WIDTH, ellipsis())
    rows = [model_row(labels[v["model"]], v) for v in views]
    headers = MODEL_HEADERS
    if shows_formats(v.get("formats", {}) for v in views):
        headers = [*MODEL_HEADERS, "KV FORMATS"]
        rows = [[*row, formats_text(v["formats"])] for row, v in zip(rows, views, strict=True)]
    return [*lines, "", table(headers, rows, right=RIGHT_ALIGNED)]


def model_fields(view: dict[str, Any]) -> list[str]:
    """A ``model_list`` view as short phrases (for ``watch``); weights when charged or
    reported, measured memory when its workers report it."""
    reported = [] if weights(view) == "-" else [f"weights {weights(view)}"]
    if view.get("memory") is not None:
        reported.append(f"measured {measured(view)}")
    if shows_formats([view.get("formats", {})]):
        reported.append(f"formats {formats_text(view['formats'])}")
    return [
        f"held {format_bytes(view['held'])}",
        *reported,
        f"reserve {format_bytes(view['reserve'])}",
        f"limit {size(view['limit'])}",
        f"weight {weight(view['weight'])}",
        f"borrowed {format_bytes(view['borrowed'])}",
        f"waiting {waiting(view)}",
    ]


def labelled_lines(label: str, label_width: int, fields: list[str], width: int) -> list[str]:
    """``label`` then ``fields`` in as few lines of at most ``width`` columns as they fit, the
    lines after the first indented under the fields."""
    indent = label_width + 1
    lines = fit_fields(fields, max(width - indent, 1), "  ")
    return [
        f"{label if i == 0 else '':<{label_width}} {line}".rstrip() for i, line in enumerate(lines)
    ]
