"""Show the pool's recent stats history; --plot draws blocks per stream and model over time.

The table has one row per recent allocator change (allocate, free, free_all, shrink; the daemon
keeps the last 256): the time the daemon recorded it (local clock, to the millisecond), blocks
in the pool, in use, and the running counters. --plot FILE.png writes a plot instead of the
table (add --table for both): from the daemon's timeline, blocks in use (and total) per stream
and the blocks each model's workers hold (K and V blocks counted apart); the timeline samples
the pool every 0.25 s while it changes and keeps the last 3600 samples (and the 16 models
holding most in each). Plotting needs matplotlib (`pip install 'vqpool[plot]'`).
"""

from __future__ import annotations

import argparse
from datetime import datetime
from pathlib import Path
from typing import Any

from vqpool.daemon.ctl.context import Ctl
from vqpool.daemon.ctl.exits import Exit
from vqpool.daemon.ctl.options import add_json, op_help, positive_int
from vqpool.daemon.ctl.plot import plot_timeline
from vqpool.daemon.ctl.render import table
from vqpool.shared.protocol import HISTORY


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--limit", type=positive_int, metavar="N", help=op_help(HISTORY, "limit"))
    parser.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.png",
        help="draw blocks per stream and per model over time into this PNG file (instead of "
        "the table, unless --table)",
    )
    parser.add_argument(
        "--table",
        action="store_true",
        help="with --plot, print the table too (without --plot it always is)",
    )
    add_json(parser)


def _clock(when: float | None) -> str:
    """A row's time, local, to the millisecond ("-" from a daemon that sends none)."""
    if when is None:
        return "-"
    return datetime.fromtimestamp(when).strftime("%H:%M:%S.%f")[:-3]


def _rows(snapshots: list[dict[str, Any]]) -> list[list[object]]:
    return [
        [
            i,
            _clock(s.get("time")),
            s["n_blocks"],
            s["n_allocations"] - s["n_frees"],
            s["n_allocations"],
            s["n_frees"],
            s["n_reused"],
            s["n_exhausted"],
            s["n_grown"],
            s["n_retired"],
            s["peak_blocks_in_use"],
            s["fragmented_count"],
        ]
        for i, s in enumerate(snapshots, 1)
    ]


def run(ctl: Ctl, args: argparse.Namespace) -> int:
    limit = {"limit": args.limit} if args.limit is not None else {}
    want_table = ctl.as_json or args.table or not args.plot
    snapshots = ctl.call("history", **limit) if want_table else []
    timeline = ctl.call("history", timeline=True, **limit) if args.plot else None
    lines = plot_timeline(timeline, args.plot) if timeline is not None else []
    if ctl.as_json:
        ctl.print_json({"snapshots": snapshots, "timeline": timeline})
        return Exit.OK
    headers = [
        "#",
        "TIME",
        "BLOCKS",
        "IN USE",
        "ALLOCS",
        "FREES",
        "REUSED",
        "EXHAUSTED",
        "GROWN",
        "RETIRED",
        "PEAK",
        "PARTIAL",
    ]
    if want_table:
        ctl.print(table(headers, _rows(snapshots)) if snapshots else "no history yet")
    if timeline is not None:
        span = timeline[-1]["time"] - timeline[0]["time"] if timeline else 0.0
        ctl.print(
            f"wrote {args.plot}: {len(timeline)} samples over {span:.1f}s; lines: "
            + ", ".join(lines)
        )
    return Exit.OK
