"""Retire free blocks so that at most TARGET_FREE stay free in a stream.

Blocks in use are never touched, and retired block ids never come back, so workers may drop
their memory. With --stream kv on a pool with separate k and v streams, each of the two is
shrunk to TARGET_FREE; on a shared-kv pool every --stream names its one stream. Prints how many
blocks were retired and the stream's new free and total counts. Shrinking to a target that is
already met retires nothing (it is safe to repeat).
"""

from __future__ import annotations

import argparse

from vqpool.daemon.ctl.context import Ctl
from vqpool.daemon.ctl.exits import Exit
from vqpool.daemon.ctl.options import add_json, non_negative_int, op_help


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--stream",
        required=True,
        choices=["k", "v", "kv"],
        help=f"{op_help('shrink', 'stream')}; kv on a k+v pool: both",
    )
    parser.add_argument(
        "--target-free",
        required=True,
        type=non_negative_int,
        metavar="N",
        help=op_help("shrink", "target_free"),
    )
    add_json(parser)


def run(ctl: Ctl, args: argparse.Namespace) -> int:
    pool_streams = list(ctl.call("stats")["streams"])
    if pool_streams == ["kv"]:
        streams = ["kv"]
    elif args.stream == "kv":
        streams = pool_streams
    else:
        streams = [args.stream]
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
