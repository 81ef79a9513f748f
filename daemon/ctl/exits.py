"""vqpoolctl's exit codes, which scripts may rely on (documented in docs/operations.md)."""

from __future__ import annotations

from enum import IntEnum


class Exit(IntEnum):
    """Process exit status of vqpoolctl."""

    OK = 0
    FAILED = 1
    """Something unexpected went wrong (the message says what)."""
    BAD_ARGUMENTS = 2
    """The command line is wrong (argparse's own status for usage errors)."""
    NOT_RUNNING = 3
    """No vqpoold answers on the run directory (for ``ps``, ``load``, ``unload``: no ``vqpool
    serve``)."""
    REFUSED = 4
    """The daemon answered with an error: no such session, a value it does not accept... (or
    the front door did: an unknown model, a load that failed)."""
    CANCELLED = 5
    """A confirmation was declined (evict without --yes answered no, or stdin closed)."""
    FIT_WITHIN_RESERVE = 10
    """``fit``: not free now, but within the model's reserve (it comes as its own work ends)."""
    FIT_AFTER_OTHERS_RETURN = 11
    """``fit``: fits once other models give back the memory they borrowed."""
    FIT_NEVER = 12
    """``fit``: never fits: over the model's limit or the budget (less other models' reserves)."""


EXIT_CODES_HELP = """exit codes:
  0  ok
  1  failed (unexpected error)
  2  bad arguments
  3  vqpoold (ps, load, unload: vqpool serve) is not running on the run directory
  4  refused by the daemon or the front door (no such session or model, a failed load)
  5  cancelled (a confirmation was declined)
  10 fit: fits within the model's reserve, not now
  11 fit: fits once other models give back borrowed memory, not now
  12 fit: never fits (over the model's limit or the budget)"""


class CtlError(Exception):
    """A failure to report in one line with its exit code (no traceback)."""

    def __init__(self, message: str, code: Exit) -> None:
        super().__init__(message)
        self.code = code
