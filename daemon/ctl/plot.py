"""Draw the daemon's per-stream timeline into a PNG (matplotlib, an optional dependency)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from vqpool.daemon.ctl.exits import CtlError, Exit


def plot_timeline(timeline: list[dict[str, Any]], path: Path) -> None:
    """Blocks in use per stream (solid) and each stream's total (dashed) over wall-clock time.

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
    times = mdates.date2num([datetime.fromtimestamp(sample["time"]) for sample in timeline])
    streams = list(timeline[0]["in_use"]) if timeline else []
    figure, axes = plt.subplots(figsize=(9, 4.5), dpi=100)
    try:
        for stream in streams:
            in_use = [sample["in_use"][stream] for sample in timeline]
            total = [sample["total"][stream] for sample in timeline]
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
        axes.set_title("vqpool: blocks in use per stream")
        axes.set_xlabel("time")
        axes.set_ylabel("blocks")
        axes.set_ylim(bottom=0)
        axes.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
        axes.grid(alpha=0.3)
        if streams:
            axes.legend(loc="upper left")
        figure.autofmt_xdate()
        figure.tight_layout()
        try:
            figure.savefig(path, format="png")
        except OSError as exc:
            raise CtlError(f"cannot write {path}: {exc}", Exit.FAILED) from exc
    finally:
        plt.close(figure)
