"""List the models the front door (`vqpool serve`) serves and what each is doing, as `ollama ps`.

Above the table, the front door's URL, pid and how many models may be loaded at once (--max-loaded).
One row per model: its name (without the prefix it does not need, as in `watch`), its state
(not_loaded, loading, loaded, unloading), its worker's pid and port, requests running and queued
(waiting for it to load), then its memory as vqpoold counts it: WEIGHTS (what its workers report
once loaded; before, as known from its safetensors headers or a built-in's config; "?" when unknown,
e.g. a hub id not downloaded yet), KV HELD (KV bytes its sessions hold, its prompt cache's among
them), CACHED (its prompt cache's), MEASURED (its processes' memory as their heartbeats report it:
weights, KV buffers, MLX's buffer cache) and SHARE (its weights, its workers' overhead and KV held
over the budget); then how long it has been idle, how long it stays loaded if it stays idle
("pinned" or "forever" where no keep-alive applies), how many times it was loaded and unloaded, and
its crashes and failed loads; below the table, each model's last error and what a load waiting for
memory needs. --json prints the control socket's answer (full names, unloads by reason: idle, room,
memory, budget, operator, shutdown), each row with ``memory`` (the figures above in bytes, share as
a fraction; null when vqpoold does not answer). Exits 3 when no `vqpool serve` runs on the run
directory."""

from __future__ import annotations

import argparse

from vqpool.daemon.ctl.context import Ctl
from vqpool.daemon.ctl.exits import Exit
from vqpool.daemon.ctl.front_door import (
    header,
    idle,
    keep_alive_left,
    labels_of,
    ledger_memory,
    memory_cells,
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
    "KV HELD",
    "CACHED",
    "MEASURED",
    "SHARE",
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
    memory = ledger_memory(ctl, answer)
    for row in answer["models"]:
        row["memory"] = memory.get(row["name"])
        if row["memory"] is not None and row["memory"]["weights"] is not None:
            row["weights_bytes"] = row["memory"]["weights"]
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
            *memory_cells(row["memory"]),
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
    right = {"PID", "PORT", "WEIGHTS", "KV HELD", "CACHED", "MEASURED", "SHARE", "IDLE"}
    ctl.print(table(HEADERS, rows, right=right | {"KEEP-ALIVE LEFT"}))
    notes = [
        f"{labels[row['name']]}: {what}: {text}"
        for row in answer["models"]
        for what, text in (("last error", row["last_error"]), ("waiting", row.get("memory_wait")))
        if text
    ]
    if notes:
        ctl.print()
        for note in notes:
            ctl.print(note)
    return Exit.OK
