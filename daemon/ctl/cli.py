"""The vqpoolctl command line: parser, dispatch, and the one place errors become exit codes.

Every failure is reported in one line on stderr with a documented exit code
(:class:`~vqpool.daemon.ctl.exits.Exit`); no traceback reaches the user except for a bug.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from types import ModuleType

from vqpool.daemon.ctl.commands import COMMANDS
from vqpool.daemon.ctl.context import Ctl
from vqpool.daemon.ctl.exits import EXIT_CODES_HELP, CtlError, Exit
from vqpool.daemon.ctl.options import DEFAULT_TIMEOUT, common_options
from vqpool.shared.config import resolve_run_dir, socket_path
from vqpool.shared.errors import VqpoolError
from vqpool.shared.front_client import FrontDoorNotRunning, FrontDoorRefused

HELP = "help"


def _summary(module: ModuleType) -> str:
    return (module.__doc__ or "").strip().split("\n", 1)[0]


def build_parser() -> argparse.ArgumentParser:
    """The vqpoolctl parser: one sub-command per module in COMMANDS, plus ``help``."""
    common = common_options()
    parser = argparse.ArgumentParser(
        prog="vqpoolctl",
        description="Inspect and steer a running vqpoold (the vqpool coordinator daemon).",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[common],
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, module in COMMANDS.items():
        sub = commands.add_parser(
            name,
            help=_summary(module),
            description=(module.__doc__ or "").strip(),
            epilog=EXIT_CODES_HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            parents=[common],
        )
        module.add_arguments(sub)
    helper = commands.add_parser(HELP, help="show the help of a command", parents=[common])
    helper.add_argument("topic", nargs="?", choices=sorted(COMMANDS), metavar="COMMAND")
    return parser


def _show_help(parser: argparse.ArgumentParser, topic: str | None) -> int:
    if topic is None:
        parser.print_help()
    else:
        parser.parse_args([topic, "--help"])  # prints the command's help and exits 0
    return Exit.OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run vqpoolctl; returns its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_usage(sys.stderr)
        print("vqpoolctl: name a command (see `vqpoolctl help`)", file=sys.stderr)
        return Exit.BAD_ARGUMENTS
    if args.command == HELP:
        return _show_help(parser, args.topic)
    if getattr(args, "action", "") is None:  # `vqpoolctl model`: which action?
        args.command_parser.print_help(sys.stderr)
        names = ", ".join(args.action_names)
        print(f"vqpoolctl {args.command}: name an action: {names}", file=sys.stderr)
        return Exit.BAD_ARGUMENTS
    try:
        run_dir = resolve_run_dir(getattr(args, "run_dir", None))
        socket_path(run_dir, "admin.sock")  # refuses a path too long for a socket
    except ValueError as exc:
        print(f"vqpoolctl: {exc}", file=sys.stderr)
        return Exit.BAD_ARGUMENTS
    ctl = Ctl(
        run_dir,
        timeout=getattr(args, "timeout", DEFAULT_TIMEOUT),
        as_json=getattr(args, "json", False),
    )
    try:
        return int(COMMANDS[args.command].run(ctl, args))
    except CtlError as exc:
        print(f"vqpoolctl: {exc}", file=sys.stderr)
        return exc.code
    except FrontDoorNotRunning as exc:
        print(
            f"vqpoolctl: {exc}; start it with `vqpool serve --run-dir {run_dir}`", file=sys.stderr
        )
        return Exit.NOT_RUNNING
    except FrontDoorRefused as exc:
        print(f"vqpoolctl: refused by vqpool serve ({exc.status}): {exc}", file=sys.stderr)
        return Exit.REFUSED
    except (VqpoolError, ValueError) as exc:
        # An error reply: the daemon refused, and said why.
        print(f"vqpoolctl: refused by vqpoold: {exc}", file=sys.stderr)
        return Exit.REFUSED
    except KeyboardInterrupt:
        return Exit.CANCELLED
    except BrokenPipeError:  # `vqpoolctl history | head`: the reader is gone, nothing to say
        # Point stdout at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return Exit.OK
    finally:
        ctl.close()
