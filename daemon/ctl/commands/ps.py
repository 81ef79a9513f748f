"""List the models the front door (`vqpool serve`) serves and what each is doing, as `ollama ps`.

Above the table, the front door's URL, pid and how many models may be loaded at once (--max-loaded).
One row per model: its name (without the prefix it does not need, as in `watch`), its state
(not_loaded, loading, loaded, unloading), its worker's pid and port, requests running and queued
(waiting for it to load), its weights' bytes as known before it loads (from its safetensors headers
or a built-in's config; "?" when unknown, e.g. a hub id not downloaded yet), how long it has been
idle, how long it stays loaded if it stays idle ("pinned" or "forever" where no keep-alive applies),
how many times it was loaded and unloaded, and its crashes and failed loads; below the table, each
model's last error. --json prints the control socket's answer (full names, unloads by reason: idle,
room, operator, shutdown). Exits 3 when no `vqpool serve` runs on the run directory.
"""

from __future__ import annotations

import argparse

from vqpool.daemon.ctl.context import Ctl
from vqpool.daemon.ctl.exits import Exit
from vqpool.daemon.ctl.front_door import (
    header,
    idle,
    keep_alive_left,
    labels_of,
    port,
    weights,
)
from vqpool.daemon.ctl.options import add_json
from vqpool.daemon.ctl.render import table

HEADERS = [
    "MODEL",
    "STATE",
    "PID",
    "PORT",
    "RUNNING",
    "QUEUED",
    "WEIGHTS",
    "IDLE",
    "KEEP-ALIVE LEFT",
    "LOADS",
    "UNLOADS",
    "CRASHES",
    "FAILED LOADS",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_json(parser)


def run(ctl: Ctl, args: argparse.Namespace) -> int:
    answer = ctl.front_door().models()
    if ctl.as_json:
        ctl.print_json(answer)
        return Exit.OK
    labels = labels_of(answer)
    rows = [
        [
            labels[row["name"]],
            row["state"],
            row["pid"],
            port(row),
            row["running"],
            row["queued"],
            weights(row),
            idle(row),
            keep_alive_left(row),
            row["loads"],
            sum(row["unloads"].values()),
            row["crashes"],
            row["load_failures"],
        ]
        for row in answer["models"]
    ]
    ctl.print(header(answer))
    ctl.print()
    ctl.print(table(HEADERS, rows, right={"PID", "PORT", "WEIGHTS", "IDLE", "KEEP-ALIVE LEFT"}))
    errors = [row for row in answer["models"] if row["last_error"]]
    if errors:
        ctl.print()
        for row in errors:
            ctl.print(f"{labels[row['name']]}: last error: {row['last_error']}")
    return Exit.OK
