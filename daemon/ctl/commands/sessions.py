"""List worker sessions: one row per worker process.

Shows each session's id (hex; `evict --session` and `owners --session` take it, or a unique
prefix), the worker's pid, model and process state, blocks and bytes held per stream, owners,
TOKENS (token slots marked used, per sequence, summed over its owners: see below), how long ago
the daemon last heard from it, and its lease: "ok", or "expired" for a worker silent past its
lease (a running worker keeps its blocks anyway; a stopped one is reaped).

TOKENS counts each sequence once (its K and V blocks hold the same tokens). A worker marks the
slots it reserves for a request as used when its cache grows (under `vqpool-worker --reserve
full`, the default, the whole prompt + max_tokens at the start), so TOKENS is what requests
have reserved, not the tokens generated so far.
"""

from __future__ import annotations

import argparse

from vqpool.daemon.ctl.context import Ctl
from vqpool.daemon.ctl.exits import Exit
from vqpool.daemon.ctl.options import add_json
from vqpool.daemon.ctl.render import duration, human_bytes, table
from vqpool.shared.protocol import session_label

TOKENS_LEGEND = (
    "TOKENS: token slots per sequence marked used (K and V count once); workers mark what they\n"
    "reserve for a request (with --reserve full, its whole need at the start), not what it has\n"
    "generated so far."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_json(parser)


def run(ctl: Ctl, args: argparse.Namespace) -> int:
    stats = ctl.call("stats")
    sessions = ctl.call("sessions")
    if ctl.as_json:
        ctl.print_json([{**s, "session": session_label(s["sid"])} for s in sessions])
        return Exit.OK
    if not sessions:
        ctl.print("no worker sessions")
        return Exit.OK
    streams = list(stats["streams"])
    rows = [
        [
            session_label(s["sid"]),
            s["pid"],
            s["model"],
            s["process"],
            *(s["blocks"].get(stream, 0) for stream in streams),
            human_bytes(s["bytes_total"]),
            s["n_owners"],
            s["tokens"],
            f"{duration(s['last_heard_s'])} ago",
            s["lease"]["state"],
        ]
        for s in sorted(sessions, key=lambda s: (s["model"], s["pid"]))
    ]
    headers = [
        "SESSION",
        "PID",
        "MODEL",
        "PROCESS",
        *(f"BLOCKS {stream.upper()}" for stream in streams),
        "BYTES",
        "OWNERS",
        "TOKENS",
        "HEARD",
        "LEASE",
    ]
    ctl.print(table(headers, rows, right={"BYTES", "HEARD"}))
    ctl.print()
    ctl.print(TOKENS_LEGEND)
    return Exit.OK
