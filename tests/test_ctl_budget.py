"""vqpoolctl budget, model list/set and fit against a live vqpoold with two real worker
processes (alpha holds 7 blocks, beta 14, at 4096 bytes each): text and --json output,
set-then-read round trips, refusals that change nothing, and fit's exit status per verdict."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
from ctl_harness import VQPOOLCTL, LivePool, ctl_json, run_ctl, run_ctl_each
from daemon_harness import RawClient, wait_until

KIB = 1024
ALPHA_HELD = 7 * 4096
BETA_HELD = 14 * 4096


@pytest.fixture
def pool() -> Iterator[LivePool]:
    live = LivePool.start("--n-blocks", "256", "--lease", "5")
    yield live
    live.stop()


def _models(pool: LivePool) -> dict[str, dict[str, Any]]:
    return {v["model"]: v for v in ctl_json(pool.run_dir, "model", "list")["models"]}


def _row(out: str, label: str) -> list[str]:
    """The cells of the last table row of model ``label`` (cells two or more spaces apart): the
    budget table comes last in ``status``."""
    line = [line for line in out.splitlines() if line.startswith(label + " ")][-1]
    return re.split(r"\s{2,}", line.strip())


def test_budget_without_one_says_so(pool: LivePool) -> None:
    budget = ctl_json(pool.run_dir, "budget")
    assert budget["budget"] is None and budget["free"] is None
    assert budget["total_held"] == ALPHA_HELD + BETA_HELD
    assert budget["waiting"] == 0
    result = run_ctl(pool.run_dir, "budget")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[:2] == ["no budget (nothing binds)", "held 84 KiB"]


def test_budget_set_then_show_round_trip(pool: LivePool) -> None:
    result = run_ctl(pool.run_dir, "budget", "1MiB")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "budget: none -> 1 MiB"
    assert lines[1].startswith("budget 1 MiB, held 84 KiB, free 940 KiB, ")
    assert lines[2] == "no parked request refused"
    budget = ctl_json(pool.run_dir, "budget")
    assert budget["budget"] == 1024 * KIB == pool.daemon.admin("budget")["budget"]
    assert budget["free"] == 1024 * KIB - ALPHA_HELD - BETA_HELD
    # A percentage is of this machine's physical memory.
    changed = ctl_json(pool.run_dir, "budget", "0.001%")
    assert changed["before"]["budget"] == 1024 * KIB
    assert changed["after"]["budget"] == psutil.virtual_memory().total // 100_000
    # Lowering the budget below what is held takes nothing back and says so.
    result = run_ctl(pool.run_dir, "budget", "64KiB")
    assert result.returncode == 0, result.stderr
    assert "OVER BUDGET by 20 KiB" in result.stdout
    assert ctl_json(pool.run_dir, "budget")["total_held"] == ALPHA_HELD + BETA_HELD


def test_budget_refusals_change_nothing(pool: LivePool) -> None:
    assert run_ctl(pool.run_dir, "budget", "1MiB").returncode == 0
    bad = run_ctl(pool.run_dir, "budget", "12XB")
    assert bad.returncode == 2 and "unknown unit 'XB'" in bad.stderr
    assert run_ctl(pool.run_dir, "budget", "0").returncode == 2
    # Reserves must fit the budget: a budget under their sum is refused by the daemon.
    assert run_ctl(pool.run_dir, "model", "set", "alpha", "--reserve", "512KiB").returncode == 0
    refused = run_ctl(pool.run_dir, "budget", "256KiB")
    assert refused.returncode == 4, refused.stdout
    assert refused.stderr.startswith("vqpoolctl: refused by vqpoold: ")
    assert len(refused.stderr.splitlines()) == 1
    assert ctl_json(pool.run_dir, "budget")["budget"] == 1024 * KIB


def test_model_list_text_and_json(pool: LivePool) -> None:
    assert run_ctl(pool.run_dir, "budget", "1MiB").returncode == 0
    listing = ctl_json(pool.run_dir, "model", "list")
    assert listing["budget"]["budget"] == 1024 * KIB
    models = {v["model"]: v for v in listing["models"]}
    assert set(models) == {"alpha", "beta"}
    alpha = models["alpha"]
    assert (alpha["held"], alpha["reserve"], alpha["limit"], alpha["weight"]) == (
        ALPHA_HELD,
        0,
        None,
        1,
    )
    assert alpha["borrowed"] == ALPHA_HELD and alpha["sessions"] == 1
    assert models["beta"]["held"] == BETA_HELD
    result = run_ctl(pool.run_dir, "model", "list")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("budget 1 MiB, held 84 KiB, free 940 KiB")
    assert lines[2].split() == [
        "MODEL",
        "HELD",
        "WEIGHTS",
        "MEASURED",
        "RESERVE",
        "LIMIT",
        "WEIGHT",
        "BORROWED",
        "ENTITLED",
        "WAITING",
        "SESSIONS",
        "RUNNING/QUEUED",
        "SETTINGS",
    ]
    row = _row(result.stdout, "alpha")
    # No memory report from these clients: weights and measured "-".
    assert row[:9] == ["alpha", "28 KiB", "-", "-", "0 B", "none", "1", "28 KiB", row[8]]
    assert row[9:11] == ["0", "1"]  # waiting, sessions
    assert row[-1] == "default" and alpha["settings_from"]["weight"] == "default"
    assert _row(result.stdout, "beta")[1] == "56 KiB"


def test_model_set_then_list_round_trip(pool: LivePool) -> None:
    assert run_ctl(pool.run_dir, "budget", "1MiB").returncode == 0
    result = run_ctl(
        pool.run_dir,
        "model",
        "set",
        "alpha",
        "--reserve",
        "64KiB",
        "--limit",
        "512KiB",
        "--weight",
        "2",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == (
        "model alpha: reserve 0 B -> 64 KiB, limit none -> 512 KiB, weight 1 -> 2"
    )
    alpha = _models(pool)["alpha"]
    assert (alpha["reserve"], alpha["limit"], alpha["weight"]) == (64 * KIB, 512 * KIB, 2)
    assert alpha["borrowed"] == 0 and alpha["configured"]
    row = _row(run_ctl(pool.run_dir, "model", "list").stdout, "alpha")
    assert row[1:8] == ["28 KiB", "-", "-", "64 KiB", "512 KiB", "2", "0 B"]
    # --limit none drops the model's own limit; the other settings stay.
    view = ctl_json(pool.run_dir, "model", "set", "alpha", "--limit", "none")
    assert view["limit"] is None and view["reserve"] == 64 * KIB and view["weight"] == 2
    # A model without workers can be configured ahead of them (with a note on stderr).
    ahead = run_ctl(pool.run_dir, "model", "set", "org/gamma", "--reserve", "128KiB", "--create")
    assert ahead.returncode == 0, ahead.stderr
    assert "no worker of model 'org/gamma' is connected" in ahead.stderr
    gamma = _models(pool)["org/gamma"]
    assert gamma["reserve"] == 128 * KIB and gamma["sessions"] == 0 and gamma["configured"]
    # Its short label, as `model list` shows it, names it (tests/test_ctl_model_names.py).
    label = run_ctl(pool.run_dir, "model", "set", "gamma", "--weight", "3")
    assert label.returncode == 0, label.stderr
    assert label.stdout.startswith("model org/gamma: weight 1 -> 3")
    assert "gamma" not in _models(pool) and _models(pool)["org/gamma"]["weight"] == 3


def test_model_set_refusals_change_nothing(pool: LivePool) -> None:
    assert run_ctl(pool.run_dir, "budget", "1MiB").returncode == 0
    assert run_ctl(pool.run_dir, "model", "set", "alpha", "--reserve", "64KiB").returncode == 0
    before = _models(pool)
    refusals = [
        (["--weight", "0"], 4),
        (["--weight", "-1"], 4),
        (["--reserve", "2MiB"], 4),  # reserves over the budget
        (["--reserve", "64KiB", "--limit", "32KiB"], 4),  # a limit under the reserve
        (["--reserve", "1.5 furlongs"], 2),
        (["--limit", "0"], 4),  # under the reserve
        (["--weight", "heavy"], 2),
        ([], 2),
    ]
    results = run_ctl_each(pool.run_dir, [["model", "set", "alpha", *a] for a, _ in refusals])
    for (args, status), result in zip(refusals, results, strict=True):
        assert result.returncode == status, (args, result.stdout, result.stderr)
        errors = result.stderr.strip().splitlines()
        assert errors[-1].startswith("vqpoolctl"), result.stderr  # after argparse's usage
        assert status == 2 or len(errors) == 1, result.stderr
        assert result.stdout == ""
    assert _models(pool) == before


def _fit(pool: LivePool, context: int, concurrency: int) -> tuple[int, dict[str, Any]]:
    result = run_ctl(
        pool.run_dir,
        "fit",
        "--model",
        "alpha",
        "--context",
        str(context),
        "--concurrency",
        str(concurrency),
        "--json",
    )
    assert result.stderr == ""
    return result.returncode, json.loads(result.stdout)


def _fit_text(pool: LivePool, concurrency: int) -> subprocess.CompletedProcess[str]:
    args = ["--model", "alpha", "--context", "16", "--concurrency", str(concurrency)]
    return run_ctl(pool.run_dir, "fit", *args)


def test_fit_exit_status_per_verdict(pool: LivePool) -> None:
    # One sequence of 16 tokens: one K and one V block of 4096 bytes.
    per_sequence = 2 * 4096
    assert run_ctl(pool.run_dir, "budget", "128KiB").returncode == 0
    assert run_ctl(pool.run_dir, "model", "set", "alpha", "--reserve", "96KiB").returncode == 0
    # Held 84 KiB of 128: 44 KiB free, alpha holds 28 of its 96 KiB reserve.
    status, answer = _fit(pool, 16, 2)
    assert (status, answer["verdict"]) == (0, "now")
    assert answer["bytes_per_sequence"] == per_sequence and answer["need"] == 2 * per_sequence
    assert answer["max_concurrency_now"] == answer["available_now"] // per_sequence
    status, answer = _fit(pool, 16, 8)  # 64 KiB: not free now, within the 96 KiB reserve
    assert (status, answer["verdict"]) == (10, "within_reserve")
    status, answer = _fit(pool, 16, 12)  # 96 KiB: all its reserve, once its own work ends
    assert (status, answer["verdict"]) == (10, "within_reserve")
    status, answer = _fit(pool, 16, 13)  # 104 KiB: over the reserve, within the budget
    assert (status, answer["verdict"]) == (11, "after_others_return")
    assert answer["most_ever"] == 128 * KIB  # beta has no reserve
    status, answer = _fit(pool, 16, 17)  # 136 KiB: more than it may ever hold
    assert (status, answer["verdict"]) == (12, "never")

    text = _fit_text(pool, 8)
    assert text.returncode == 10
    lines = text.stdout.splitlines()
    assert lines[0] == "alpha: 8 x 16 tokens need 64 KiB (8 KiB per sequence)"
    assert lines[1].startswith("fits within its reserve")
    assert lines[3] == "reserve 96 KiB, limit 128 KiB, budget 128 KiB"
    assert lines[4] == (
        f"largest concurrency of 16 tokens: {answer['max_concurrency_now']} now, "
        f"{answer['max_concurrency_ever']} ever"
    )
    text = run_ctl(
        pool.run_dir, "fit", "--model", "alpha", "--context", "16", "--concurrency", "17"
    )
    assert text.returncode == 12
    assert "never fits: over the 128 KiB it may ever hold (the budget of 128 KiB" in text.stdout
    limited = ["--reserve", "0", "--limit", "64KiB"]
    assert run_ctl(pool.run_dir, "model", "set", "alpha", *limited).returncode == 0
    never = run_ctl(
        pool.run_dir, "fit", "--model", "alpha", "--context", "16", "--concurrency", "9"
    )
    assert never.returncode == 12
    assert "never fits: over the model's limit of 64 KiB" in never.stdout


def test_fit_of_a_model_without_workers_is_refused(pool: LivePool) -> None:
    result = run_ctl(pool.run_dir, "fit", "--model", "nobody", "--context", "16")
    assert result.returncode == 4
    assert "nobody" in result.stderr and len(result.stderr.splitlines()) == 1
    assert run_ctl(pool.run_dir, "fit", "--model", "alpha", "--context", "0").returncode == 2


def test_status_shows_the_budget_per_model(pool: LivePool) -> None:
    assert run_ctl(pool.run_dir, "budget", "1MiB").returncode == 0
    assert run_ctl(pool.run_dir, "model", "set", "beta", "--reserve", "32KiB").returncode == 0
    status = ctl_json(pool.run_dir, "status")
    assert status["budget"]["budget"] == 1024 * KIB
    assert status["budget"]["free"] == 1024 * KIB - ALPHA_HELD - BETA_HELD
    beta = next(v for v in status["budget"]["models"] if v["model"] == "beta")
    assert (beta["held"], beta["reserve"], beta["borrowed"]) == (BETA_HELD, 32 * KIB, 24 * KIB)
    out = run_ctl(pool.run_dir, "status").stdout
    assert "budget 1 MiB, held 84 KiB, free 940 KiB, reserved 32 KiB" in out
    assert _row(out, "beta")[1:8] == ["56 KiB", "-", "-", "32 KiB", "none", "1", "24 KiB"]


def _watch_once(pool: LivePool, columns: int) -> list[str]:
    """One plain frame of ``vqpoolctl watch`` (stdout a pipe), ``columns`` wide."""
    done = subprocess.run(
        [VQPOOLCTL, "--run-dir", str(pool.run_dir), "watch", "--count", "1"],
        capture_output=True,
        text=True,
        timeout=20,
        env={**os.environ, "COLUMNS": str(columns)},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_watch_shows_the_budget_per_model(pool: LivePool) -> None:
    assert run_ctl(pool.run_dir, "budget", "1MiB").returncode == 0
    assert run_ctl(pool.run_dir, "model", "set", "alpha", "--limit", "512KiB").returncode == 0
    lines = _watch_once(pool, 100)
    assert (
        "budget 1 MiB  held 84 KiB  free 940 KiB  reserved 0 B  unused reserves 0 B  waiting 0"
        in (lines)
    )
    assert (
        "alpha held 28 KiB  reserve 0 B  limit 512 KiB  weight 1  borrowed 28 KiB  waiting 0"
        in lines
    )
    assert "beta  held 56 KiB  reserve 0 B  limit none  weight 1  borrowed 56 KiB  waiting 0" in (
        lines
    )
    # Narrower: the same fields, wrapped under the model's label.
    lines = _watch_once(pool, 60)
    assert all(len(line) <= 60 for line in lines), lines
    at = lines.index("alpha held 28 KiB  reserve 0 B  limit 512 KiB  weight 1")
    assert lines[at + 1] == "      borrowed 28 KiB  waiting 0"
    record = json.loads(run_ctl(pool.run_dir, "watch", "--count", "1", "--json").stdout)
    assert record["budget"]["budget"] == 1024 * KIB
    alpha = next(v for v in record["budget"]["models"] if v["model"] == "alpha")
    assert alpha["limit"] == 512 * KIB and alpha["held"] == ALPHA_HELD


def test_help_of_the_budget_commands(pool: LivePool) -> None:
    for topic, words in [
        ("budget", "or 40% of this"),
        ("model", "model set NAME [--reserve SIZE] [--limit SIZE|none] [--weight W]"),
        ("fit", "fits once others return"),
    ]:
        result = run_ctl(pool.run_dir, "help", topic)
        assert result.returncode == 0 and words in result.stdout, result.stdout
        assert "12 fit: never fits" in result.stdout


@pytest.fixture
def tight_pool() -> Iterator[LivePool]:
    """alpha and beta hold 84 KiB of a 96 KiB budget given at start-up."""
    live = LivePool.start("--n-blocks", "256", "--lease", "5", "--budget", "96KiB")
    yield live
    live.stop()


def _parked_gamma(pool: LivePool) -> RawClient:
    """A session of model gamma (4096 bytes per block) whose allocate of 16 KiB waits at the
    daemon: 12 KiB are free."""
    raw = RawClient(pool.run_dir)
    hello = raw.call(
        "hello",
        {
            "pid": os.getpid(),
            "model": "gamma",
            "nonce": os.urandom(8).hex(),
            "bytes_per_block": 4096,
        },
    )
    assert hello["ok"], hello
    raw.sid, raw.boot = hello["result"]["sid"], hello["result"]["boot"]
    args = {"stream": "k", "n_tokens": 4 * 16, "owner": "g", "wait": 30}
    raw.send(raw.encode("allocate", args))
    wait_until(lambda: pool.daemon.admin("budget")["waiting"] == 1, timeout=5)
    return raw


def test_a_waiting_request_shows_everywhere_and_a_lower_budget_refuses_it(
    tight_pool: LivePool,
) -> None:
    pool = tight_pool
    raw = _parked_gamma(pool)
    try:
        shown = run_ctl(pool.run_dir, "budget").stdout.splitlines()
        assert shown[:3] == ["budget 96 KiB", "held 84 KiB", "free 12 KiB"]
        assert shown[-1] == "waiting 1"
        listing = run_ctl(pool.run_dir, "model", "list").stdout
        gamma = _row(listing, "gamma")
        assert gamma[1] == "0 B" and gamma[10] == "1", gamma
        assert re.fullmatch(r"1 \(16 KiB, \d+\.\ds\)", gamma[9]), gamma
        status = ctl_json(pool.run_dir, "status")
        view = next(v for v in status["budget"]["models"] if v["model"] == "gamma")
        assert (view["waiting"], view["waiting_bytes"]) == (1, 16 * KIB)
        assert status["budget"]["waiting"] == 1
        frame = _watch_once(pool, 100)
        line = next(line for line in frame if line.startswith("gamma held"))
        assert re.search(r"waiting 1 \(16 KiB, \d+\.\ds\)$", line), frame
        # 16 KiB can never fit an 8 KiB budget: the parked request is refused, and counted.
        lowered = run_ctl(pool.run_dir, "budget", "8KiB")
        assert lowered.returncode == 0, lowered.stderr
        assert lowered.stdout.splitlines()[0] == "budget: 96 KiB -> 8 KiB"
        assert "refused 1 parked request(s)" in lowered.stdout
        reply = raw.recv()
        assert not reply["ok"] and "budget" in reply["error"]["message"], reply
        assert ctl_json(pool.run_dir, "budget")["waiting"] == 0
    finally:
        raw.close()
