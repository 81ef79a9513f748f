"""scripts/demo --short, end to end: vqpool serve (vqpoold, two workers behind one URL), load,
live view, shrink, summary, the front door's view, SIGTERM.

Runs ``scripts/demo.py`` with this interpreter: ``scripts/demo`` itself only sets up .venv
(which the test suite already runs in) and then execs that same file.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parent.parent / "scripts" / "demo.py"


def run_demo(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run the demo in its own process group, so a timeout also ends its daemon and workers."""
    process = subprocess.Popen(
        [sys.executable, str(DEMO), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        raise AssertionError(f"the demo took over {timeout}s:\n{out}\n{err}") from None
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def test_demo_short_runs_end_to_end() -> None:
    # 3 s of load instead of --short's 6: every phase, row and count below still shows.
    done = run_demo("--short", "--duration", "3", timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "builtin:llama" in out and "builtin:qwen3" in out
    # The live view printed lines (stdout is not a TTY here), each one only when the pool or
    # the requests changed, with labelled numbers; then the summary and the shrink.
    live = [line for line in out.splitlines() if re.match(r"\[ *\d+\.\ds\] pool ", line)]
    assert len(live) >= 2, out
    assert re.search(
        r"\] pool \d+/96 blocks in use \(k\+v\), [\d.]+ \w+ \| builtin:llama: ", live[0]
    )
    assert re.search(r"blocks \d+, [\d.]+ \w+, running \d+, queued \d+", live[-1])
    states = [line.split("] ", 1)[1] for line in live]
    assert all(a != b for a, b in itertools.pairwise(states)), live
    assert "peak blocks" in out and "exhaustions" in out
    assert "blocks in use after the load: 0; audit: ok" in out
    shrink = re.search(r"Shrink \(vqpoolctl shrink\): (\d+) blocks retired", out)
    assert shrink and int(shrink.group(1)) > 0
    assert "stopped workers and vqpoold (SIGTERM: exit status 0, 0 of its 3 processes left)" in out
    # Both models behind the front door's one URL, each loaded by its first request there.
    url = re.search(r"serving builtin:llama, builtin:qwen3 on (http://\S+)", out)
    assert url and f"clients for 3s at {url.group(1)}" in out, out
    for model in ("builtin:llama", "builtin:qwen3"):
        assert re.search(rf"{model}: loaded by its first request in [\d.]+ s", out), out
        assert re.search(rf"{model} +loaded +\d+ +http://\S+ +0 +0 +1 +0 ", out), out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("builtin:")]
    # model, reserve (2 words), weight, weight/bytes/decode shares, requests, tokens, ...
    summary = {row[0]: row for row in rows if len(row) == 20}
    assert set(summary) == {"builtin:llama", "builtin:qwen3"}
    assert "bytes share" in out and "decode share" in out
    for row in summary.values():
        assert row[1:3] == ["64", "KiB"]  # the reserve the demo configures
        assert all(re.fullmatch(r"\d+%|-", share) for share in row[4:7]), row
        assert int(row[7]) > 0 and int(row[8]) > 0  # requests, tokens
    assert summary["builtin:llama"][4] == "67%" and summary["builtin:qwen3"][4] == "33%"
    assert all(int(row[14]) >= int(row[15]) >= 0 for row in summary.values())  # by reclaim
    assert all(int(row[16]) >= 0 for row in summary.values())  # held
    assert all(re.fullmatch(r"[\d.]+s|-", row[19]) for row in summary.values())  # p99 TTFT
    preemptions = re.search(r"Preemptions under load: (\d+) \([\d.]+/s over [\d.]+s\)", out)
    assert preemptions, out
    # The summary says what the counts mean, then what to try next, and ends there.
    assert re.search(r"Preemptions: [\d.]+/s is (normal|more than)", out), out
    assert "the request cheapest to recompute gives way" in out
    assert "Weights govern memory, not CPU" in out
    assert "not expected to\nfollow the weights" in out
    lines = out.rstrip().splitlines()
    closing = lines[max(i for i, line in enumerate(lines) if line.startswith("Try next")) :]
    assert closing[0].startswith("Try next, by hand") and len(closing) == 7, closing
    assert "vqpool serve --model builtin:llama --model builtin:qwen3" in closing[1]
    assert closing[2].lstrip().startswith("curl http://127.0.0.1:8080/v1/chat/completions")
    assert closing[-3].lstrip().startswith("curl http://127.0.0.1:8080/v1/models")
    assert closing[-2].lstrip().startswith("vqpoolctl watch")
    assert closing[-1].lstrip().startswith("vqpool serve --model PATH")
