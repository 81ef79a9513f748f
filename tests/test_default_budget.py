"""The budget `vqpool serve` gives a vqpoold it starts when nobody chose one: computed from the
machine's memory (the Linux path from psutil's numbers, the macOS path from a working set passed
in), printed at start, and the one a real daemon then has; a budget given, or a running
daemon's, wins and is said."""

from __future__ import annotations

from collections.abc import Callable

import psutil
import pytest
from ctl_harness import ctl_json
from front_harness import FrontDoor
from vqpool.daemon.server.machine_memory import (
    MIN_DEFAULT_BUDGET,
    default_budget,
    machine_default_budget,
    metal_working_set,
    physical_memory,
)
from vqpool.worker.testing.launch import DaemonProcess

GiB = 2**30


def test_linux_default_is_three_quarters_of_memory_less_two_gib() -> None:
    total = psutil.virtual_memory().total
    assert physical_memory() == total
    budget = default_budget(total, None)
    assert budget.nbytes == int((total - 2 * GiB) * 0.75) // 2**20 * 2**20
    assert budget.basis.startswith("75% of physical memory (")
    assert default_budget(18 * GiB, None).nbytes == 12 * GiB


def test_macos_default_is_three_quarters_of_metals_working_set() -> None:
    budget = default_budget(16 * GiB, 12 * GiB)
    assert budget.nbytes == 9 * GiB
    assert budget.basis == "75% of Metal's recommended working set (12 GiB)"


def test_a_small_machine_gets_the_floor() -> None:
    assert default_budget(2 * GiB, None).nbytes == MIN_DEFAULT_BUDGET
    assert default_budget(1 * GiB, None).nbytes == GiB // 2
    assert default_budget(2 * GiB, 2**20).basis.startswith("the smallest default")


def test_this_machine_uses_its_own_numbers() -> None:
    assert machine_default_budget() == default_budget(physical_memory(), metal_working_set())


def test_serve_without_a_budget_starts_vqpoold_with_the_default() -> None:
    expected = machine_default_budget()
    with FrontDoor("--model", "builtin:llama") as front:
        assert ctl_json(front.run_dir, "budget")["budget"] == expected.nbytes
        line = next(x for x in front.start_output.splitlines() if x.startswith("budget: "))
        assert line.endswith(f"({expected.basis}); --budget to choose")


@pytest.mark.parametrize(
    ("args", "config"),
    [
        (("--budget", "3GiB"), None),
        ((), '[vqpoold]\nbudget = "3GiB"\n'),
    ],
)
def test_a_budget_given_is_the_daemons(args: tuple[str, ...], config: str | None) -> None:
    with FrontDoor("--model", "builtin:llama", *args, config=config) as front:
        assert ctl_json(front.run_dir, "budget")["budget"] == 3 * GiB
        assert "budget: 3 GiB\n" in front.start_output


def test_a_running_daemons_budget_is_said(start_daemon: Callable[..., DaemonProcess]) -> None:
    front = FrontDoor("--model", "builtin:llama")
    start_daemon("--budget", "2GiB", run_dir=front.run_dir)
    with front:
        assert ctl_json(front.run_dir, "budget")["budget"] == 2 * GiB
        assert (
            "budget: 2 GiB, the running vqpoold's (vqpoolctl budget SIZE changes it)\n"
            in front.start_output
        )
