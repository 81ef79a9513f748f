"""``vqpoolctl history``: the allocator's history rows carry the time the daemon recorded them,
the table shows it, and ``--plot FILE`` writes the plot alone unless ``--table`` asks for the
table too. A real daemon and real worker sessions (tests/ctl_harness.py)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
from ctl_harness import LivePool, run_ctl


@pytest.fixture(scope="module")
def pool() -> Iterator[LivePool]:
    live = LivePool.start("--n-blocks", "128", spread=True)  # allocations 0.3 s apart
    yield live
    live.stop()


def test_history_rows_carry_the_time_they_were_recorded(pool: LivePool) -> None:
    rows = pool.daemon.admin("history")
    assert len(rows) == 5
    times = [row["time"] for row in rows]
    assert all(isinstance(t, float) for t in times), rows
    assert times == sorted(times) and times[-1] <= time.time()
    # The allocations were 0.3 s apart, so were their rows' times.
    assert all(later - earlier >= 0.25 for earlier, later in itertools.pairwise(times))
    # The seed's fields are all still there beside the time.
    assert rows[-1]["n_allocations"] - rows[-1]["n_frees"] == 21
    assert pool.daemon.admin("history", limit=2) == rows[-2:]


def test_history_table_has_a_time_column(pool: LivePool) -> None:
    rows = pool.daemon.admin("history")
    result = run_ctl(pool.run_dir, "history")
    assert result.returncode == 0, result.stderr
    header, *lines = result.stdout.splitlines()
    assert header.split()[:3] == ["#", "TIME", "BLOCKS"]
    shown = [line.split()[1] for line in lines]
    assert shown == [datetime.fromtimestamp(r["time"]).strftime("%H:%M:%S.%f")[:-3] for r in rows]


def test_history_plot_writes_the_plot_alone(pool: LivePool, tmp_path: Path) -> None:
    png = tmp_path / "history.png"
    result = run_ctl(pool.run_dir, "history", "--plot", str(png))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"wrote {png}: "), result.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_history_plot_with_table_prints_the_table_too(pool: LivePool, tmp_path: Path) -> None:
    png = tmp_path / "history.png"
    result = run_ctl(pool.run_dir, "history", "--plot", str(png), "--table")
    assert result.returncode == 0, result.stderr
    header, *rows, wrote = result.stdout.splitlines()
    assert header.split()[:3] == ["#", "TIME", "BLOCKS"]
    assert len(rows) == 5
    assert wrote.startswith(f"wrote {png}: ")
