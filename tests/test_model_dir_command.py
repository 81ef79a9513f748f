"""``python -m vqpool.worker.testing.model_dirs DIR --arch ARCH``: the shell's way to write a
model directory for a quick local try; ``vqpool-worker --model DIR`` then serves it through a
real daemon."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import remove_tree, short_tmpdir
from serving_harness import ServingStack
from vqpool.worker.testing.model_dirs import ARCHITECTURES

COMMAND = [sys.executable, "-m", "vqpool.worker.testing.model_dirs"]


@pytest.fixture
def base() -> Iterator[Path]:
    path = short_tmpdir("vqc")
    yield path
    remove_tree(path)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*COMMAND, *args], capture_output=True, text=True, timeout=120)


def test_model_dir_command_help_lists_the_architectures() -> None:
    result = _run("--help")
    assert result.returncode == 0, result.stderr
    for arch in ARCHITECTURES:
        assert arch in result.stdout
    assert "--seed" in result.stdout


def test_model_dir_command_refuses_an_unknown_architecture(base: Path) -> None:
    result = _run(str(base / "m"), "--arch", "gpt9")
    assert result.returncode == 2
    assert "invalid choice" in result.stderr
    assert not (base / "m").exists()


def test_model_dir_command_writes_a_directory_vqpool_worker_serves(base: Path) -> None:
    model_dir = base / "tiny-llama"
    result = _run(str(model_dir), "--arch", "llama", "--seed", "3")
    assert result.returncode == 0, result.stderr
    assert f"vqpool-worker --model {model_dir}" in result.stdout
    assert (model_dir / "config.json").is_file()
    stack = ServingStack([str(model_dir)]).start()
    try:
        reply = stack.complete(
            str(model_dir), {"model": str(model_dir), "prompt": "Hello", "max_tokens": 8}
        )
        assert reply.status == 200, reply
        assert reply.body["choices"][0]["text"]
    finally:
        stack.stop()
