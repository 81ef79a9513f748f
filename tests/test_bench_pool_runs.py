"""bench_pool.py runs end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def test_bench_pool_quick_run_prints_every_measurement() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_pool.py"), "--quick"],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    for label in (
        "allocate(1 block)+free",
        "allocate+free_all 256 blocks",
        "mark_used",
        "reverse order",
        "random order",
        "1,048,576 blocks:",
    ):
        assert label in out, f"{label!r} missing from:\n{out}"
