"""Helpers for the vqpoolctl tests: run the real console script, and a daemon with two real
worker processes holding blocks (built from daemon_harness, nothing mocked)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daemon_harness import AgentProcess, remove_tree, short_tmpdir
from vqpool.worker.testing.launch import DaemonProcess

VQPOOLCTL = str(Path(sys.executable).with_name("vqpoolctl"))


def run_ctl(
    run_dir: Path, *args: str, stdin: str | None = None, timeout: float = 20.0
) -> subprocess.CompletedProcess[str]:
    """``vqpoolctl --run-dir RUN_DIR ARGS...`` as a subprocess, output captured."""
    return subprocess.run(
        [VQPOOLCTL, "--run-dir", str(run_dir), *args],
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_ctl_each(
    run_dir: Path, commands: list[list[str]]
) -> list[subprocess.CompletedProcess[str]]:
    """``run_ctl`` of each command, run side by side (for commands that change nothing: each
    is a third of a second of imports); the results in the order given."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(lambda args: run_ctl(run_dir, *args), commands))


def ctl_json(run_dir: Path, *args: str) -> Any:
    """The parsed ``--json`` output of a command that must succeed."""
    result = run_ctl(run_dir, *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def session_hex(worker: AgentProcess) -> str:
    return f"{worker.session_id:x}"


@dataclass
class LivePool:
    """A vqpoold and two workers, "alpha" and "beta", each holding blocks.

    alpha: owner "a1" holds 40 tokens of k and of v (3 + 3 blocks, the last of each 8/16 full),
    owner "a2" holds 16 tokens of k (1 full block). beta: owner 7 holds 100 tokens of k and of v
    (7 + 7 blocks). Both declare 4096 bytes per block.
    """

    base: Path
    daemon: DaemonProcess
    alpha: AgentProcess
    beta: AgentProcess

    @property
    def run_dir(self) -> Path:
        return self.daemon.run_dir

    @classmethod
    def start(cls, *daemon_args: str, spread: bool = False) -> LivePool:
        """Start it all; with ``spread``, allocations are 0.3 s apart so the daemon's timeline
        (sampled every 0.25 s) records the pool growing."""
        base = short_tmpdir()
        daemon = DaemonProcess(base / "run", *daemon_args).start()
        alpha = AgentProcess(daemon.run_dir, "alpha")
        beta = AgentProcess(daemon.run_dir, "beta")
        steps = [
            (alpha, ("k", 40, "a1")),
            (alpha, ("v", 40, "a1")),
            (alpha, ("k", 16, "a2")),
            (beta, ("k", 100, 7)),
            (beta, ("v", 100, 7)),
        ]
        for worker, args in steps:
            worker.call("allocate", *args)
            if spread:
                time.sleep(0.3)
        return cls(base, daemon, alpha, beta)

    def stop(self) -> None:
        for worker in (self.alpha, self.beta):
            worker.stop()
        self.daemon.stop()
        remove_tree(self.base)
