"""vqpoold's exit statuses: one per reason it refuses to start, so a service manager or a script
can tell them apart without parsing the message; and the error that carries one out of start-up."""

from __future__ import annotations

import textwrap
from enum import IntEnum


class ExitStatus(IntEnum):
    """What vqpoold's exit status means (the one line on stderr says the details)."""

    STOPPED = 0
    ALREADY_RUNNING = 1
    BAD_SETTINGS = 2
    BAD_RUN_DIR = 3
    BAD_LOCK_FILE = 4
    METRICS_PORT = 5


MEANINGS = {
    ExitStatus.STOPPED: "stopped cleanly by SIGTERM or SIGINT",
    ExitStatus.ALREADY_RUNNING: "already running: another vqpoold holds the run directory's lock "
    "(the message names its pid)",
    ExitStatus.BAD_SETTINGS: "bad settings: a command-line option, config file or value",
    ExitStatus.BAD_RUN_DIR: "unusable run directory or socket path: not a private directory of "
    "yours, a path too long for a socket, or something other than a socket where one goes",
    ExitStatus.BAD_LOCK_FILE: "unusable lock file: a symlink, not a plain file, or not openable",
    ExitStatus.METRICS_PORT: "the --metrics-port cannot be served (in use, not allowed)",
}


def exit_status_help() -> str:
    """The exit statuses as a ``--help`` epilog."""
    return "exit statuses:\n" + "\n".join(
        textwrap.fill(meaning, 79, initial_indent=f"  {status.value}  ", subsequent_indent=" " * 5)
        for status, meaning in MEANINGS.items()
    )


class StartupError(Exception):
    """vqpoold cannot start; the message says why and what to do. Exit status in ``status``."""

    def __init__(self, message: str, status: ExitStatus = ExitStatus.BAD_SETTINGS) -> None:
        super().__init__(message)
        self.status = status
