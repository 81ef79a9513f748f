"""Live view of the pool, redrawn every INTERVAL seconds; quit with q or Ctrl-C.

Shows, per stream, blocks in use against the total as a bar with the free count; per model and
stream, the blocks its workers hold as bars (on the first stream's line the bytes they hold, K
and V together, and the bytes their prompt caches hold of all that) and the requests its workers
are
running and have queued (as the workers last reported them in their heartbeat; "-" for a
worker that does not report them); fragmentation; and the rates of block allocations and of
refused (exhausted) allocations since the previous refresh; then the memory budget (budget,
bytes held and free, reserves, requests waiting) and per model its bytes held, reserve, limit,
weight, bytes borrowed above its reserve and requests waiting for memory with their bytes
(and, when some model's blocks are quantized, its blocks and bytes per block format); when a
front door (`vqpool serve`) runs on the run directory, its URL and pid and each of its models'
state and requests running and queued (as `vqpoolctl ps`; --json lines: "front_door").
Lines fit the terminal's width;
model names lose their org or directory prefix, and long ones their middle, keeping the part
that tells them apart. When stdout is not a terminal (a pipe or a file), each refresh is
printed as plain lines (no escape codes), frames two blank lines apart, COLUMNS (default 100)
wide. With --json, prints one JSON object per refresh instead (JSON lines, until Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import shutil
import textwrap
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TextIO

from vqpool.daemon.ctl.budgets import budget_fields, labelled_lines, model_fields
from vqpool.daemon.ctl.context import Ctl
from vqpool.daemon.ctl.exits import Exit
from vqpool.daemon.ctl.front_door import front_door_or_none, model_lines
from vqpool.daemon.ctl.labels import model_labels
from vqpool.daemon.ctl.options import add_json, positive_float, positive_int
from vqpool.daemon.ctl.render import bar, duration, ellipsis, fit_fields, human_bytes, percent
from vqpool.daemon.ctl.summaries import in_use, per_model, pool_line
from vqpool.daemon.ctl.terminal import Terminal


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--interval",
        type=positive_float,
        default=1.0,
        metavar="SECONDS",
        help="seconds between refreshes (default 1)",
    )
    parser.add_argument(
        "--count",
        type=positive_int,
        metavar="N",
        help="stop after N refreshes (default: until q or Ctrl-C)",
    )
    add_json(parser)


@dataclass(frozen=True)
class Reading:
    """What one refresh read from the daemon."""

    at: float
    stats: dict[str, Any]
    sessions: list[dict[str, Any]]
    budgets: dict[str, Any]
    """The ``model_list`` reply: the budget map and one view per model."""
    front_door: dict[str, Any] | None
    """The front door's answer on its control socket (None: no ``vqpool serve`` runs)."""

    @classmethod
    def take(cls, ctl: Ctl) -> Reading:
        return cls(
            time.monotonic(),
            ctl.call("stats"),
            ctl.call("sessions"),
            ctl.call("model_list"),
            front_door_or_none(ctl),
        )

    def rates(self, previous: Reading | None) -> dict[str, float | None]:
        """Blocks allocated and allocations exhausted per second since ``previous``."""
        if previous is None or self.at <= previous.at:
            return {"allocations_per_s": None, "exhausted_per_s": None}
        elapsed = self.at - previous.at
        now, before = self.stats["stats"], previous.stats["stats"]
        return {
            "allocations_per_s": (now["n_allocations"] - before["n_allocations"]) / elapsed,
            "exhausted_per_s": (now["n_exhausted"] - before["n_exhausted"]) / elapsed,
        }


def _rate(value: float | None, unit: str) -> str:
    return "-" if value is None else f"{value:.1f} {unit}"


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def _bar_lines(heads: list[str], fractions: list[float], tails: list[str], width: int) -> list[str]:
    """``head [bar] tail`` lines whose bars line up and take the width the texts leave; with
    less than 5 columns left for the bars, ``head tail`` lines (the numbers matter more)."""
    head_width = max(len(h) for h in heads)
    tail_width = max(len(t) for t in tails)
    bar_width = width - head_width - tail_width - 4
    if bar_width < 5:
        return [
            f"{head:<{head_width}} {tail}".rstrip() for head, tail in zip(heads, tails, strict=True)
        ]
    return [
        f"{head:<{head_width}} [{bar(fraction, bar_width)}] {tail}".rstrip()
        for head, fraction, tail in zip(heads, fractions, tails, strict=True)
    ]


def render(reading: Reading, previous: Reading | None, width: int, interval: float) -> list[str]:
    """The screen for one refresh, every line at most ``width`` columns."""
    stats = reading.stats
    st = stats["stats"]
    used = in_use(stats)
    rates = reading.rates(previous)
    clock = datetime.now().strftime("%H:%M:%S")
    header = [
        f"vqpoold pid {stats['pid']}",
        f"up {duration(stats['uptime_s'])}",
        f"boot {stats['boot_id']}",
        f"every {interval:g}s",
        "q: quit",
        clock,
    ]
    lines = [*fit_fields(header, width, "  "), *textwrap.wrap(f"pool: {pool_line(stats)}", width)]
    lines.append("")
    streams = stats["streams"]
    lines += _bar_lines(
        list(streams),
        [used[s] / c["total"] if c["total"] else 0.0 for s, c in streams.items()],
        [f"{used[s]}/{c['total']} in use, {c['free']} free" for s, c in streams.items()],
        width,
    )
    lines.append("")
    lines += fit_fields(
        [
            f"fragmentation {percent(st['fragmentation'])}",
            f"allocations {_rate(rates['allocations_per_s'], 'blocks/s')}",
            f"exhaustions {_rate(rates['exhausted_per_s'], '/s')} ({st['n_exhausted']} total)",
            f"sessions {stats['sessions']}",
            f"owners {stats['owners']}",
        ],
        width,
    )
    lines.append("")
    models = per_model(reading.sessions)
    views = reading.budgets["models"]
    labels = model_labels(
        sorted({*models, *(v["model"] for v in views)}), max(12, width // 3), ellipsis()
    )
    if models:
        lines += _model_bars(models, labels, streams, width)
    else:
        lines.append("no worker sessions")
    lines += _budget_lines(reading.budgets, labels, width)
    if reading.front_door is not None:
        lines += ["", *model_lines(reading.front_door, width)]
    return lines


def _budget_lines(budgets: dict[str, Any], labels: dict[str, str], width: int) -> list[str]:
    """The budget, then one model per line (wrapped under the label when too long)."""
    lines = ["", *fit_fields(budget_fields(budgets["budget"]), width, "  ")]
    views = budgets["models"]
    label_width = max((len(labels[v["model"]]) for v in views), default=0)
    for view in views:
        lines += labelled_lines(labels[view["model"]], label_width, model_fields(view), width)
    return lines


def _model_bars(
    models: dict[str, dict[str, Any]],
    labels: dict[str, str],
    streams: dict[str, dict[str, int]],
    width: int,
) -> list[str]:
    """Per model and stream, the blocks held as a bar, with requests; on the model's first
    line the bytes it holds and, of those, the bytes its prompt caches hold: both K and V bytes
    together (a stream's own bytes beside the cache's K+V would show cached above held)."""
    label_width = max(len(labels[name]) for name in models)
    heads: list[str] = []
    fractions: list[float] = []
    held_texts: list[str] = []
    loads: list[str] = []
    for name, model in models.items():
        running, queued = f"running {_count(model['running'])}", f"queued {_count(model['queued'])}"
        # One count per stream line keeps the lines short; a shared-kv pool has one line.
        model_loads = [running, queued] if len(streams) > 1 else [f"{running}, {queued}"]
        for i, (stream, counts) in enumerate(streams.items()):
            held = model["blocks"].get(stream, 0)
            heads.append(f"{labels[name]:<{label_width}} {stream}")
            fractions.append(held / counts["total"] if counts["total"] else 0.0)
            held_text = f"{held} blocks"
            if i == 0:
                held_text += f", held {human_bytes(model['bytes_total'])}"
                if model["prompt_cache"] is not None:
                    held_text += f" (cached {human_bytes(model['prompt_cache']['bytes'])})"
            held_texts.append(held_text)
            loads.append(model_loads[i] if i < len(model_loads) else "")
    held_width = max(len(text) for text in held_texts)
    tails = [f"{text:<{held_width}}  {load}" for text, load in zip(held_texts, loads, strict=True)]
    return _bar_lines(heads, fractions, tails, width)


def _json_lines(ctl: Ctl, interval: float, count: int | None) -> int:
    previous: Reading | None = None
    n = 0
    try:
        while True:
            reading = Reading.take(ctl)
            record = {
                "time": time.time(),
                "in_use": in_use(reading.stats),
                "streams": reading.stats["streams"],
                "fragmentation": reading.stats["stats"]["fragmentation"],
                **reading.rates(previous),
                "models": per_model(reading.sessions),
                "budget": {**reading.budgets["budget"], "models": reading.budgets["models"]},
                "front_door": reading.front_door,
            }
            print(json.dumps(record, sort_keys=True), file=ctl.out, flush=True)
            n += 1
            if count is not None and n >= count:
                return Exit.OK
            previous = reading
            time.sleep(interval)
    except KeyboardInterrupt:
        return Exit.OK


def _plain_frames(ctl: Ctl, interval: float, count: int | None) -> int:
    """Frames as plain lines, two blank lines apart: stdout is a file or a pipe."""
    previous: Reading | None = None
    n = 0
    try:
        while True:
            reading = Reading.take(ctl)
            width = shutil.get_terminal_size((100, 30)).columns
            if n:
                ctl.out.write("\n\n")
            ctl.out.write("\n".join(render(reading, previous, width, interval)) + "\n")
            ctl.out.flush()
            n += 1
            if count is not None and n >= count:
                return Exit.OK
            previous = reading
            time.sleep(interval)
    except KeyboardInterrupt:
        return Exit.OK


def _is_terminal(out: TextIO) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):
        return False


def run(ctl: Ctl, args: argparse.Namespace) -> int:
    if ctl.as_json:
        return _json_lines(ctl, args.interval, args.count)
    if not _is_terminal(ctl.out):
        return _plain_frames(ctl, args.interval, args.count)
    reading = Reading.take(ctl)  # before taking over the screen: "not running" stays readable
    previous: Reading | None = None
    n = 0
    try:
        with Terminal(ctl.out, ctl.stdin) as terminal:
            while True:
                width, _ = terminal.size()
                terminal.draw(render(reading, previous, width, args.interval))
                n += 1
                if args.count is not None and n >= args.count:
                    return Exit.OK
                if terminal.wait_for_quit(args.interval):
                    return Exit.OK
                previous, reading = reading, Reading.take(ctl)
    except KeyboardInterrupt:
        return Exit.OK
