"""Plain-text rendering for vqpoolctl: tables, sizes, durations, bars."""

from __future__ import annotations

import sys
from collections.abc import Collection, Sequence


def table(
    headers: Sequence[str], rows: Sequence[Sequence[object]], right: Collection[str] = ()
) -> str:
    """Rows under headers in aligned columns: numbers and the ``right`` columns right-aligned,
    other text left-aligned."""
    cells = [[str(h) for h in headers], *[[_cell(v) for v in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [
        headers[i] in right or (bool(rows) and all(isinstance(row[i], int | float) for row in rows))
        for i in range(len(headers))
    ]
    lines = []
    for row in cells:
        parts = [
            text.rjust(width) if right else text.ljust(width)
            for text, width, right in zip(row, widths, numeric, strict=True)
        ]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def human_bytes(n: int | float) -> str:
    """``n`` bytes in binary units: 512 B, 64.0 KiB, 1.5 GiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def duration(seconds: float) -> str:
    """A duration for people: 0.4s, 12.3s, 5m07s, 2h03m, 3d04h."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def percent(fraction: float) -> str:
    return f"{100 * fraction:.1f}%"


def fit_fields(fields: Sequence[str], width: int, gap: str = "   ") -> list[str]:
    """``fields`` joined by ``gap`` into as few lines as keep each within ``width`` columns (a
    field longer than ``width`` gets a line of its own)."""
    lines: list[str] = []
    for text in fields:
        if lines and len(lines[-1]) + len(gap) + len(text) <= width:
            lines[-1] += gap + text
        else:
            lines.append(text)
    return lines


def ellipsis() -> str:
    """The mark for elided text: "…" where stdout takes UTF-8, "~" otherwise."""
    return "…" if _unicode_ok() else "~"


def _unicode_ok() -> bool:
    encoding = (getattr(sys.stdout, "encoding", None) or "").lower()
    return encoding.replace("-", "") == "utf8"


def bar(fraction: float, width: int) -> str:
    """A horizontal bar ``width`` cells wide, filled to ``fraction`` (clamped to 0..1)."""
    full, empty = ("█", "░") if _unicode_ok() else ("#", ".")
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return full * filled + empty * (width - filled)
