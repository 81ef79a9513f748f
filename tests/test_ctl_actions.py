"""A vqpoolctl command that has actions (``model``, ``cache``), named without one, shows that
command's help (its actions and what each does) rather than a bare usage error: on stderr with
exit 2 (bad arguments), as argparse reports a command line that asks for nothing runnable; the
daemon is never asked. ``vqpoolctl help model`` is the way to ask for it (stdout, exit 0)."""

from __future__ import annotations

from pathlib import Path

import pytest
from ctl_harness import run_ctl

ACTIONS = {"model": ("list", "set", "unset"), "cache": ("list", "drop")}


@pytest.mark.parametrize("command", sorted(ACTIONS))
def test_a_command_without_its_action_shows_the_command_help(command: str, tmp_path: Path) -> None:
    result = run_ctl(tmp_path / "no-daemon", command)  # no daemon: it must not be needed
    assert result.returncode == 2, result
    assert result.stdout == ""
    helped = run_ctl(tmp_path / "no-daemon", "help", command)
    assert helped.returncode == 0, helped
    # The whole help of the command, as `vqpoolctl help COMMAND` prints it...
    assert helped.stdout in result.stderr
    for action in ACTIONS[command]:
        assert f"    {action} " in result.stderr  # ...which lists each action with a summary
    # ...and one closing line saying what was missing.
    assert result.stderr.splitlines()[-1] == (
        f"vqpoolctl {command}: name an action: {', '.join(ACTIONS[command])}"
    )
