"""List active owners (requests) with the blocks they hold and how full those blocks are.

One row per owner: the session, pid and model holding it, blocks per stream, TOKENS and FILL.
With --session, only that session's owners.

TOKENS: token slots of the owner's sequence marked used (its K and V blocks hold the same
tokens: counted once). A worker marks the slots it reserves for a request as used when its
cache grows (under `vqpool-worker --reserve full`, the default, the whole prompt + max_tokens at
the start), so this is what the request reserved, not what it has generated so far.
FILL: TOKENS / the token slots of the blocks holding the sequence: how much of the memory held
the reservation covers (the rest is the last block's tail and the cache's growth reserve).
"""

from __future__ import annotations

import argparse

from vqpool.daemon.ctl.commands.sessions import TOKENS_LEGEND
from vqpool.daemon.ctl.context import Ctl
from vqpool.daemon.ctl.exits import Exit
from vqpool.daemon.ctl.options import add_json
from vqpool.daemon.ctl.render import percent, table
from vqpool.shared.protocol import session_label

FILL_LEGEND = (
    "FILL: TOKENS / the slots of the blocks held (the rest: the last block's tail and the\n"
    "cache's growth reserve)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--session",
        metavar="S",
        help="only this session's owners (hex id as `sessions` shows it, or a unique prefix)",
    )
    add_json(parser)


def run(ctl: Ctl, args: argparse.Namespace) -> int:
    stats = ctl.call("stats")
    if args.session is None:
        owners = ctl.call("owners")
    else:
        owners = ctl.call("owners", sid=ctl.find_session(args.session)["sid"])
    if ctl.as_json:
        ctl.print_json(
            [
                {**o, "session": None if o["sid"] is None else session_label(o["sid"])}
                for o in owners
            ]
        )
        return Exit.OK
    if not owners:
        ctl.print("no active owners")
        return Exit.OK
    streams = list(stats["streams"])
    rows = [
        [
            str(o["owner"]),
            None if o["sid"] is None else session_label(o["sid"]),
            o["pid"],
            o["model"],
            *(o["blocks"].get(stream, 0) for stream in streams),
            o["tokens"],
            percent(o["fill"]),
        ]
        for o in sorted(owners, key=lambda o: (o["model"] or "", str(o["owner"])))
    ]
    headers = [
        "OWNER",
        "SESSION",
        "PID",
        "MODEL",
        *(f"BLOCKS {stream.upper()}" for stream in streams),
        "TOKENS",
        "FILL",
    ]
    ctl.print(table(headers, rows, right={"FILL"}))
    ctl.print()
    ctl.print(TOKENS_LEGEND)
    ctl.print(FILL_LEGEND)
    return Exit.OK
