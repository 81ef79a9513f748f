"""Options several vqpoolctl commands share, and argument help from the admin ops' declarations."""

from __future__ import annotations

import argparse

from vqpool.daemon.ctl.exits import EXIT_CODES_HELP
from vqpool.shared.config import RUN_DIR_ENV
from vqpool.shared.protocol import ADMIN_OP_SPECS

DEFAULT_TIMEOUT = 3.0
"""Seconds to wait for the daemon's reply (it answers in well under a millisecond)."""


def common_options() -> argparse.ArgumentParser:
    """Options every command takes, before or after the command name (a parent parser for
    each command's parser, and for the actions of a command that has several)."""
    common = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    common.add_argument(
        "--run-dir",
        metavar="DIR",
        help=f"the daemon's run directory (env {RUN_DIR_ENV}; default as for vqpoold)",
    )
    common.add_argument(
        "--timeout",
        type=positive_float,
        metavar="SECONDS",
        help=f"how long to wait for the daemon's reply (default {DEFAULT_TIMEOUT:g})",
    )
    return common


def add_actions(
    parser: argparse.ArgumentParser,
) -> argparse._SubParsersAction[argparse.ArgumentParser]:
    """The actions of a command that has several (``model list``, ``model set``...), to fill
    with :func:`add_action`. Named without an action, the command shows its own help (the
    actions and what each does) and exits 2 (see ``cli.main``), not a bare usage error."""
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    parser.set_defaults(command_parser=parser, action_names=actions.choices)
    return actions


def add_action(
    actions: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    summary: str,
    description: str,
    *,
    json: bool = True,
) -> argparse.ArgumentParser:
    """The parser of action ``name`` of a command that has several (``model list``, ``model
    set``...): its one-line ``summary``, its ``description``, the exit codes, the common options
    and (with ``json``) ``--json``."""
    parser = actions.add_parser(
        name,
        help=summary,
        description=description,
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[common_options()],
    )
    if json:
        add_json(parser)
    return parser


def add_json(parser: argparse.ArgumentParser) -> None:
    """``--json``: print the result as JSON, for scripts."""
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def op_help(op: str, field: str) -> str:
    """The help the admin op ``op`` declares for its argument ``field``: for an option that
    takes the same value as that argument."""
    return ADMIN_OP_SPECS[op].param(field).help


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = non_negative_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value
