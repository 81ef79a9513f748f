"""Model names given to vqpoolctl and the daemon's admin ops: the short label `model list` and
`watch` show is taken for the model's full name when exactly one known model has it, an ambiguous
one is refused naming the candidates, a name nobody knows is refused unless --create is given,
and `model unset` removes a model's live settings. A real vqpoold with real worker processes
(tests/worker_agent.py), driven through the real vqpoolctl."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ctl_harness import ctl_json, run_ctl
from daemon_harness import AgentProcess, remove_tree, short_tmpdir
from vqpool.shared.model_names import resolve_model
from vqpool.worker.testing.launch import DaemonProcess

KIB = 1024
LLAMA = "mlx-community/Llama-3.2-1B-Instruct-4bit"
A_TINY = "/models/a/tiny"
B_TINY = "/models/b/tiny"


@pytest.fixture(scope="module")
def pool() -> Iterator[tuple[DaemonProcess, list[AgentProcess]]]:
    """A daemon with a 4 MiB budget and a worker of each of LLAMA, A_TINY and B_TINY, the
    llama one holding two blocks."""
    base = short_tmpdir()
    daemon = DaemonProcess(base / "run", "--n-blocks", "64", "--budget", "4MiB").start()
    workers = [AgentProcess(daemon.run_dir, name) for name in (LLAMA, A_TINY, B_TINY)]
    workers[0].call("allocate", "k", 32, "r1")
    yield daemon, workers
    for worker in workers:
        worker.stop()
    daemon.stop()
    remove_tree(base)


def _models(run_dir: Path) -> dict[str, dict[str, Any]]:
    return {v["model"]: v for v in ctl_json(run_dir, "model", "list")["models"]}


def test_the_rule_in_one_place() -> None:
    known = [LLAMA, A_TINY, B_TINY, "builtin:qwen3"]
    assert resolve_model(LLAMA, known) == LLAMA
    assert resolve_model("Llama-3.2-1B-Instruct-4bit", known) == LLAMA
    assert resolve_model("a/tiny", known) == A_TINY
    assert resolve_model("builtin:qwen3", known) == "builtin:qwen3"
    assert resolve_model("builtin:qwen", known) is None
    assert resolve_model("nothing", known) is None
    with pytest.raises(ValueError, match=r"ambiguous.*'/models/a/tiny', '/models/b/tiny'"):
        resolve_model("tiny", known)


def test_a_label_names_its_model_in_every_admin_command(
    pool: tuple[DaemonProcess, list[AgentProcess]],
) -> None:
    daemon, _ = pool
    run_dir = daemon.run_dir
    label = "Llama-3.2-1B-Instruct-4bit"
    listed = run_ctl(run_dir, "model", "list").stdout
    assert any(line.startswith(label + " ") for line in listed.splitlines()), listed

    result = run_ctl(run_dir, "model", "set", label, "--weight", "2")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"model {LLAMA}: weight 1 -> 2")
    assert _models(run_dir)[LLAMA]["weight"] == 2 and label not in _models(run_dir)

    fit = run_ctl(run_dir, "fit", "--model", label, "--context", "16")
    assert fit.returncode == 0, fit.stderr
    assert fit.stdout.startswith(f"{LLAMA}: 1 x 16 tokens")
    assert run_ctl(run_dir, "fit", "--model", "a/tiny", "--context", "16").returncode == 0

    drop = ctl_json(run_dir, "cache", "drop", label)
    assert drop["model"] == LLAMA and drop["sessions"] == 1

    unset = run_ctl(run_dir, "model", "unset", label)
    assert unset.returncode == 0, unset.stderr
    assert _models(run_dir)[LLAMA]["weight"] == 1


def test_an_ambiguous_label_is_refused_naming_the_candidates(
    pool: tuple[DaemonProcess, list[AgentProcess]],
) -> None:
    run_dir = pool[0].run_dir
    before = _models(run_dir)
    for args in (
        ["model", "set", "tiny", "--weight", "2"],
        ["fit", "--model", "tiny", "--context", "16"],
        ["cache", "drop", "tiny"],
        ["model", "unset", "tiny"],
    ):
        result = run_ctl(run_dir, *args)
        assert result.returncode == 4, (args, result.stderr)
        assert f"'{A_TINY}', '{B_TINY}'" in result.stderr, (args, result.stderr)
    assert _models(run_dir) == before


def test_a_typo_is_refused_unless_created_and_unset_removes_it(
    pool: tuple[DaemonProcess, list[AgentProcess]],
) -> None:
    daemon, _ = pool
    run_dir = daemon.run_dir
    before = _models(run_dir)
    typo = run_ctl(run_dir, "model", "set", "builtin:qwen", "--weight", "2")
    assert typo.returncode == 4
    assert "no model 'builtin:qwen'" in typo.stderr and "--create" in typo.stderr
    assert _models(run_dir) == before
    with pytest.raises(ValueError, match="no model 'builtin:qwen'"):
        daemon.admin("model_set", model="builtin:qwen", weight=2.0)
    fit = run_ctl(run_dir, "fit", "--model", "builtin:qwen", "--context", "16")
    assert fit.returncode == 4 and "no worker of model builtin:qwen is" in fit.stderr

    # Ahead of its workers, on purpose: --create.
    ahead = run_ctl(run_dir, "model", "set", "builtin:qwen3", "--reserve", "64KiB", "--create")
    assert ahead.returncode == 0, ahead.stderr
    assert _models(run_dir)["builtin:qwen3"]["reserve"] == 64 * KIB
    # Once it exists, no --create is needed to change it.
    assert run_ctl(run_dir, "model", "set", "builtin:qwen3", "--weight", "3").returncode == 0

    # unset: the phantom is gone; a served model falls back to its defaults and stays.
    gone = run_ctl(run_dir, "model", "unset", "builtin:qwen3")
    assert gone.returncode == 0, gone.stderr
    assert "builtin:qwen3" not in _models(run_dir)
    assert run_ctl(run_dir, "model", "set", LLAMA, "--limit", "1MiB").returncode == 0
    assert run_ctl(run_dir, "model", "unset", LLAMA).returncode == 0
    llama = _models(run_dir)[LLAMA]
    assert (llama["limit"], llama["held"], llama["sessions"]) == (None, 2 * 4096, 1)
    # Nothing to unset: refused, nothing changes.
    again = run_ctl(run_dir, "model", "unset", LLAMA)
    assert again.returncode == 4 and "has no live settings" in again.stderr
    missing = run_ctl(run_dir, "model", "unset", "builtin:qwen3")
    assert missing.returncode == 4 and "no model 'builtin:qwen3'" in missing.stderr
    assert _models(run_dir) == before
