"""Draw the daemon's timeline (per stream and per model) into a PNG (matplotlib, optional)."""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path
from typing import Any

from vqpool.daemon.ctl.exits import CtlError, Exit
from vqpool.daemon.ctl.labels import model_labels


def plot_timeline(timeline: list[dict[str, Any]], path: Path) -> list[str]:
    """Blocks in use per stream (solid), each stream's total (dashed) and the blocks each
    model's workers hold (dash-dotted) over wall-clock time; returns the lines' labels, in the
    legend's order. ``timeline`` is the daemon's ``history(timeline=True)`` reply (never
    empty: the daemon samples its pool once at start).

    Raises:
        CtlError: matplotlib is missing (FAILED), or the file cannot be written (FAILED).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never needs a display
        import matplotlib.dates as mdates
        import matplotlib.pyplot as plt
    except ImportError:
        raise CtlError("--plot needs matplotlib: pip install 'vqpool[plot]'", Exit.FAILED) from None
    # The daemon records a sample only when the pool changed: the last one holds until now.
    samples = [*timeline, {**timeline[-1], "time": max(time.time(), timeline[-1]["time"])}]
    times = mdates.date2num([datetime.fromtimestamp(sample["time"]) for sample in samples])
    streams = list(timeline[0]["in_use"])
    models = sorted({model for sample in samples for model in sample["models"]})
    labels = model_labels(models, 32)
    drawn: list[str] = []
    figure, axes = plt.subplots(figsize=(9, 4.5), dpi=100)
    try:
        for stream in streams:
            in_use = [sample["in_use"][stream] for sample in samples]
            total = [sample["total"][stream] for sample in samples]
            line = axes.step(times, in_use, where="post", label=f"{stream} in use")[0]
            axes.step(
                times,
                total,
                where="post",
                linestyle="--",
                color=line.get_color(),
                alpha=0.6,
                label=f"{stream} total",
            )
            drawn += [f"{stream} in use", f"{stream} total"]
        for model in models:
            held = [sample["models"].get(model, 0) for sample in samples]
            label = f"{labels[model]} (blocks held)"
            axes.step(times, held, where="post", linestyle="-.", label=label)
            drawn.append(label)
        axes.set_title("vqpool: blocks in use per stream and held per model")
        axes.set_xlabel("time")
        axes.set_ylabel("blocks")
        axes.set_ylim(bottom=0)
        locator = mdates.AutoDateLocator()
        axes.xaxis.set_major_locator(locator)
        axes.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
        axes.grid(alpha=0.3)
        axes.legend(loc="upper left")
        figure.tight_layout()
        try:
            figure.savefig(path, format="png")
        except OSError as exc:
            raise CtlError(f"cannot write {path}: {exc}", Exit.FAILED) from exc
    finally:
        plt.close(figure)
    return drawn
