"""Live view of the pool, redrawn every INTERVAL seconds; quit with q or Ctrl-C.

Shows, per stream, blocks in use against the total as a bar with the free count; per model and
stream, the blocks its workers hold as bars (with bytes held); fragmentation; and the rates of
block allocations and of refused (exhausted) allocations since the previous refresh. With
--json, prints one JSON object per refresh instead (JSON lines, until Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from vqpool.daemon.ctl.context import Ctl
from vqpool.daemon.ctl.exits import Exit
from vqpool.daemon.ctl.options import add_json, positive_float
from vqpool.daemon.ctl.render import bar, duration, human_bytes, percent
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
    add_json(parser)


@dataclass(frozen=True)
class Reading:
    """What one refresh read from the daemon."""

    at: float
    stats: dict[str, Any]
    sessions: list[dict[str, Any]]

    @classmethod
    def take(cls, ctl: Ctl) -> Reading:
        return cls(time.monotonic(), ctl.call("stats"), ctl.call("sessions"))

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


def render(reading: Reading, previous: Reading | None, width: int, interval: float) -> list[str]:
    """The screen for one refresh, ``width`` columns wide."""
    stats = reading.stats
    st = stats["stats"]
    used = in_use(stats)
    rates = reading.rates(previous)
    clock = datetime.now().strftime("%H:%M:%S")
    lines = [
        f"vqpoold pid {stats['pid']}  up {duration(stats['uptime_s'])}  boot {stats['boot_id']}"
        f"  every {interval:g}s  q: quit  {clock}",
        f"pool: {pool_line(stats)}",
        "",
    ]
    bar_width = max(10, width - 40)
    for stream, counts in stats["streams"].items():
        total = counts["total"]
        fraction = used[stream] / total if total else 0.0
        lines.append(
            f"{stream:<6} [{bar(fraction, bar_width)}] {used[stream]}/{total} in use, "
            f"{counts['free']} free"
        )
    lines += [
        "",
        f"fragmentation {percent(st['fragmentation'])}   allocations "
        f"{_rate(rates['allocations_per_s'], 'blocks/s')}   exhaustions "
        f"{_rate(rates['exhausted_per_s'], '/s')} ({st['n_exhausted']} total)   sessions "
        f"{stats['sessions']}   owners {stats['owners']}",
        "",
    ]
    models = per_model(reading.sessions)
    if not models:
        lines.append("no worker sessions")
        return lines
    name_width = min(24, max(len(name) for name in models))
    model_bar = max(10, width - name_width - 40)
    for name, model in models.items():
        for stream, counts in stats["streams"].items():
            held = model["blocks"].get(stream, 0)
            fraction = held / counts["total"] if counts["total"] else 0.0
            lines.append(
                f"{name[:name_width]:<{name_width}} {stream:<3}[{bar(fraction, model_bar)}] "
                f"{held} blocks, {human_bytes(model['bytes'].get(stream, 0))}"
            )
    return lines


def _json_lines(ctl: Ctl, interval: float) -> int:
    previous: Reading | None = None
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
            }
            print(json.dumps(record, sort_keys=True), file=ctl.out, flush=True)
            previous = reading
            time.sleep(interval)
    except KeyboardInterrupt:
        return Exit.OK


def run(ctl: Ctl, args: argparse.Namespace) -> int:
    if ctl.as_json:
        return _json_lines(ctl, args.interval)
    reading = Reading.take(ctl)  # before taking over the screen: "not running" stays readable
    previous: Reading | None = None
    try:
        with Terminal(ctl.out, ctl.stdin) as terminal:
            while True:
                width, _ = terminal.size()
                terminal.draw(render(reading, previous, width, args.interval))
                if terminal.wait_for_quit(args.interval):
                    return Exit.OK
                previous, reading = reading, Reading.take(ctl)
    except KeyboardInterrupt:
        return Exit.OK
