"""bench_budget_ledger.py runs end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def test_bench_budget_ledger_quick_run_prints_every_measurement() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_budget_ledger.py"), "--quick"],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    for label in (
        "try_grant+credit, nobody waits, 3 models",
        "1000 models",
        "allocate(1 block)+free",
        "request that must wait",
        "credit+grants()",
    ):
        assert label in out, f"{label!r} missing from:\n{out}"


def test_bench_budget_quick_run_prints_both_phases_and_the_round_trip() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_budget.py"), "--quick"],
        check=True,
        capture_output=True,
        text=True,
        timeout=240,
    ).stdout
    for label in (
        "today        builtin:llama",
        "with budget  builtin:qwen3",
        "p99 wait ratio (least / most favoured)",
        "allocate(1 block)+free round trip p50: budget off",
    ):
        assert label in out, f"{label!r} missing from:\n{out}"
