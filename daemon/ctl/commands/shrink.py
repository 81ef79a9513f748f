"""Retire free blocks so that at most TARGET_FREE stay free in a stream.

Blocks in use are never touched, and retired block ids never come back, so workers may drop
their memory. On a pool with separate k and v streams a sequence holds a K block and a V block
for the same tokens, so --stream k, v or kv shrinks both streams to TARGET_FREE each (a V block
whose K block is gone could never be used); --only-stream k|v shrinks that one alone and warns.
On a shared-kv pool every stream name means its one stream. Prints how many blocks were retired
and each stream's new free and total counts. Shrinking to a target that is already met retires
nothing (it is safe to repeat).
"""

from __future__ import annotations

import argparse
import sys

from vqpool.daemon.ctl.context import Ctl
from vqpool.daemon.ctl.exits import Exit
from vqpool.daemon.ctl.options import add_json, non_negative_int, op_help
from vqpool.shared.protocol import SHRINK


def add_arguments(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--stream",
        choices=["k", "v", "kv"],
        help="stream to shrink; on a k+v pool k, v and kv all shrink both streams together",
    )
    which.add_argument(
        "--only-stream",
        choices=["k", "v"],
        metavar="{k,v}",
        help="shrink this stream of a k+v pool alone, leaving the other with blocks that "
        "cannot be used",
    )
    parser.add_argument(
        "--target-free",
        required=True,
        type=non_negative_int,
        metavar="N",
        help=op_help(SHRINK, "target_free"),
    )
    add_json(parser)


def _streams(ctl: Ctl, args: argparse.Namespace) -> list[str]:
    """The streams to shrink, saying on stderr what the pool's shape made of the request."""
    pool_streams = list(ctl.call("stats")["streams"])
    if pool_streams == ["kv"]:
        return pool_streams
    if args.only_stream is not None:
        other = "v" if args.only_stream == "k" else "k"
        print(
            f"vqpoolctl: warning: only stream {args.only_stream} shrunk; the {other} stream keeps "
            f"its free blocks, which no sequence can use without a {args.only_stream} block",
            file=sys.stderr,
        )
        return [args.only_stream]
    if args.stream != "kv":
        print(
            f"vqpoolctl: shrinking k and v together (a sequence needs both; --only-stream "
            f"{args.stream} shrinks {args.stream} alone)",
            file=sys.stderr,
        )
    return pool_streams


def run(ctl: Ctl, args: argparse.Namespace) -> int:
    streams = _streams(ctl, args)
    results = [ctl.call("shrink", stream=s, target_free=args.target_free) for s in streams]
    if ctl.as_json:
        ctl.print_json(results)
        return Exit.OK
    for r in results:
        ctl.print(
            f"stream {r['stream']}: retired {r['retired']} free block(s); now {r['n_free']} free "
            f"of {r['n_total']} ({r['n_total'] - r['n_free']} in use)"
        )
    return Exit.OK
