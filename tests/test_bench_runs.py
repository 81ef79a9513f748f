"""Every benchmark script with a quick mode runs end to end and prints each measurement."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"

QUICK_RUNS = {
    "bench_pool.py": (
        120,
        (
            "allocate(1 block)+free",
            "allocate+free_all 256 blocks",
            "mark_used",
            "reverse order",
            "random order",
            "1,048,576 blocks:",
        ),
    ),
    "bench_claim.py": (60, ("one claim message of 256 owners x 16 one-id groups",)),
    "bench_budget_ledger.py": (
        120,
        (
            "try_grant+credit, nobody waits, 3 models",
            "1000 models",
            "allocate(1 block)+free",
            "request that must wait",
            "credit+grants()",
        ),
    ),
    "bench_prompt_cache.py": (
        240,
        (
            "(a) chat: TTFT per turn",
            "| 2 |",
            "(b) 2 users sharing a system prompt",
            "| vqpool-worker |",
            "hits of",
            "copy costs in-process",
        ),
    ),
    "bench_vs_mlx_server.py": (
        120,
        (
            "| concurrency | mlx_lm.server tok/s | vqpool pooled tok/s | vqpool --no-pool tok/s",
            "| 2 | vqpool pooled |",
            "| 2 | vqpool --no-pool |",
            "| 2 | mlx_lm.server |",
        ),
    ),
    "bench_budget.py": (
        240,
        (
            "today        builtin:llama",
            "with budget  builtin:qwen3",
            "p99 wait ratio (least / most favoured)",
            "allocate(1 block)+free round trip p50: budget off",
        ),
    ),
}

# Options after --quick. bench_budget's load phases are 4 s each by default in quick mode;
# 2 s still gives every row a hundred-odd requests (its own runs measure with 20 s).
QUICK_OPTIONS = {"bench_budget.py": ("--seconds", "2")}


@pytest.mark.parametrize("script", sorted(QUICK_RUNS))
def test_quick_run_prints_every_measurement(script: str) -> None:
    timeout, labels = QUICK_RUNS[script]
    out = subprocess.run(
        [sys.executable, str(SCRIPTS / script), "--quick", *QUICK_OPTIONS.get(script, ())],
        check=True,
        capture_output=True,
        text=True,
        timeout=timeout,
    ).stdout
    for label in labels:
        assert label in out, f"{label!r} missing from {script}'s output:\n{out}"
