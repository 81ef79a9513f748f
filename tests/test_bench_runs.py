"""Every benchmark script with a quick mode runs end to end and prints each measurement."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
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
    "bench_draft.py": (
        240,
        (
            "| vqpool + draft |",
            "| mlx_lm.server + draft |",
            "| vqpool + draft / mlx_lm.server + draft |",
            "identical text on all four servers: 1/1 prompts",
        ),
    ),
    "bench_front_door.py": (
        240,
        (
            "| concurrency | TTFT p50 worker (ms) | TTFT p50 front door (ms) | TTFT delta (ms)",
            "| 1 |",
            "| 8 |",
            "CPU per token: front door",
            "| 6 | 0 |",  # two models: 6 requests, none failed
            "| vqpool serve |",
            "| mlx_lm.server |",
            "vqpool serve exit statuses on SIGTERM: [0]",
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


@pytest.fixture(scope="module")
def quick_runs(
    request: pytest.FixtureRequest,
) -> Iterator[dict[str, tuple[subprocess.Popen[bytes], Path]]]:
    """The quick runs of the selected tests, started at once (each is mostly process start-ups
    and waits, and only its output is checked here), with stdout going to a file; each test
    waits for its own."""
    selected = {
        item.callspec.params["script"]
        for item in request.session.items
        if item.path == request.path and hasattr(item, "callspec")
    }
    base = Path(tempfile.mkdtemp(prefix="vqbench", dir="/tmp"))
    runs: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    try:
        for script in sorted(selected):
            argv = [
                sys.executable,
                str(SCRIPTS / script),
                "--quick",
                *QUICK_OPTIONS.get(script, ()),
            ]
            out_path = base / f"{script}.out"
            with open(out_path, "wb") as out, open(base / f"{script}.err", "wb") as err:
                runs[script] = (subprocess.Popen(argv, stdout=out, stderr=err), out_path)
        yield runs
    finally:
        for process, _ in runs.values():
            if process.poll() is None:
                process.kill()
                process.wait()
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("script", sorted(QUICK_RUNS))
def test_quick_run_prints_every_measurement(
    quick_runs: dict[str, tuple[subprocess.Popen[bytes], Path]], script: str
) -> None:
    timeout, labels = QUICK_RUNS[script]  # seconds from the start of all of them
    process, out_path = quick_runs[script]
    try:
        returncode = process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    out = out_path.read_text()
    err = out_path.with_suffix(".err").read_text()
    assert returncode == 0, f"{script} exited with {returncode}:\n{out}\n{err[-3000:]}"
    for label in labels:
        assert label in out, f"{label!r} missing from {script}'s output:\n{out}"
