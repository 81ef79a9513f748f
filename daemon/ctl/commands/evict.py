"""Force-end a worker session: free every block its owners hold and release the owner ids.

For a hung worker that is still running (the daemon reaps dead and stopped workers itself, but
never a running one). The worker's next call fails with a no-session error. Shows what will be
freed and asks for confirmation on stdin unless --yes is given; a declined or unanswered prompt
exits 5 and changes nothing.
"""

from __future__ import annotations

import argparse
import sys

from vqpool.daemon.ctl.context import Ctl
from vqpool.daemon.ctl.exits import CtlError, Exit
from vqpool.daemon.ctl.options import add_json
from vqpool.daemon.ctl.render import human_bytes
from vqpool.shared.protocol import session_label


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--session",
        required=True,
        metavar="S",
        help="session to evict (hex id as `sessions` shows it, or a unique prefix)",
    )
    parser.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    add_json(parser)


def _confirmed(ctl: Ctl, question: str) -> bool:
    # The prompt goes to stderr: stdout carries only the result (and stays valid --json).
    print(f"{question} [y/N] ", end="", file=sys.stderr, flush=True)
    answer = ctl.stdin.readline()
    if not answer:  # stdin closed: nobody said yes
        print(file=sys.stderr)
    return answer.strip().lower() in ("y", "yes")


def run(ctl: Ctl, args: argparse.Namespace) -> int:
    session = ctl.find_session(args.session)
    label = session_label(session["sid"])
    if not args.yes:
        question = (
            f"Evict session {label} (pid {session['pid']}, model {session['model']!r}, "
            f"{session['process']}): free {session['n_blocks']} block(s) "
            f"({human_bytes(session['bytes_total'])}) of {session['n_owners']} owner(s)?"
        )
        if not _confirmed(ctl, question):
            raise CtlError(f"session {label} not evicted", Exit.CANCELLED)
    result = ctl.call("evict_session", sid=session["sid"])
    if ctl.as_json:
        ctl.print_json({**result, "session": label})
        return Exit.OK
    ctl.print(
        f"evicted session {label} (pid {result['pid']}): freed {result['blocks_freed']} "
        f"block(s) of {result['owners_freed']} owner(s)"
    )
    return Exit.OK
